"""LayerSwapper and KV resizing on a tiny Llama: in-place swaps inside the weights arena, the per-layer fence,
bit-identical restores, the ledger, and restores that wait for live KV blocks."""
from __future__ import annotations

import threading

import pytest
import torch

from elastic_hf.engine.sampling_params import SamplingParams
from morph_helpers import assert_bit_identical, packed_outside_arena_bytes, snapshot, tiny_morph_model


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_morph_model(tiny_checkpoint("llama"))


def _layers(model):
    return model.worker.loaded.layers


def _block_bytes(model) -> int:
    return model.worker.pool.layout.block_bytes


def test_round_trips_through_every_precision_restore_bit_identical_weights(model):
    original = snapshot(model)
    ledger_before = model.worker.budget.used_bytes("weights")
    for precision in ("w4", "w8", "w4", "fp", "w8", "fp"):
        state = model.morph.to_precision("all", precision)
        assert state["layer_counts"][precision] == 3 and state["pending"] == []
        for i in range(3):
            assert _layers(model)[i] is model.worker.morph.swapper.store.module(i, precision)
    assert_bit_identical(model, original)
    assert model.worker.budget.used_bytes("weights") == ledger_before
    assert model.morph.state()["swaps"] == {"fp->w4": 3, "w4->w8": 3, "w8->w4": 3, "w4->fp": 3, "fp->w8": 3,
                                            "w8->fp": 3}


def test_ledger_moves_exactly_the_region_bytes_and_the_kv_cache_takes_them(model):
    placement = model.worker.weights.placement
    arena = model.worker.weights.arena
    blocks_before = model.worker.pool.num_blocks
    weights_before = model.worker.budget.used_bytes("weights")
    model.morph.to_precision([0, 2], "w4")
    expected = sum(placement.layers[i].nbytes - placement.slots[i]["w4"].nbytes for i in (0, 2))
    assert weights_before - model.worker.budget.used_bytes("weights") == expected
    assert arena.committed_bytes + packed_outside_arena_bytes(model) == model.worker.budget.used_bytes("weights")
    for i in (0, 2):
        assert arena.is_committed(placement.slots[i]["w4"].offset, placement.slots[i]["w4"].nbytes)
        assert not arena.is_committed(placement.layers[i].offset, placement.layers[i].nbytes)
    # every byte beyond the headroom became KV blocks, in the worker's pool and in the engine's allocator
    headroom = model.worker.morph.headroom_bytes
    assert model.worker.pool.num_blocks > blocks_before
    assert model.instances[0].engine.scheduler.kv.num_total == model.worker.pool.num_blocks
    assert headroom <= model.worker.budget.free_bytes < headroom + _block_bytes(model)
    model.morph.to_precision("all", "fp")
    assert model.worker.pool.num_blocks == blocks_before and model.worker.budget.used_bytes("weights") == weights_before


class GatedCopier:
    """A copier whose copies stay 'in flight' until the test opens the gate."""

    def __init__(self, inner):
        self.inner, self.gate = inner, threading.Event()

    def submit(self, dst, src):
        handle = self.inner.submit(dst, src)
        done, gate = handle.done, self.gate
        handle.done = lambda: gate.is_set() and done()
        return handle

    def sync_compute(self):
        self.inner.sync_compute()


def test_a_layer_switches_only_at_a_boundary_after_its_copy(model):
    swapper = model.worker.morph.swapper
    inner = swapper.copier
    swapper.copier = GatedCopier(inner)
    try:
        fp_module = _layers(model)[1]
        prompt = list(range(5, 25))
        reference = model.generate(prompt, max_tokens=6).outputs[0].token_ids
        swapper.request(1, "w4")
        assert swapper.poll() == []                   # started: slot committed, copy in flight
        assert swapper.in_flight() == [1]
        # Forwards keep using the fp layer while the copy is in flight: same tokens as before.
        assert model.generate(prompt, max_tokens=6).outputs[0].token_ids == reference
        assert _layers(model)[1] is fp_module and swapper.precision[1] == "fp"
        swapper.copier.gate.set()
        swapper.wait_copies()
        assert _layers(model)[1] is fp_module         # done, but nothing switches outside a boundary
        records = swapper.poll()
        assert [(r.layer, r.src, r.dst) for r in records] == [(1, "fp", "w4")]
        assert _layers(model)[1] is swapper.store.module(1, "w4")
    finally:
        swapper.copier = inner
        model.morph.to_precision("all", "fp")


class FailingCopier:
    """A copier whose copies fail (a device error, a bad image): what the copy thread raises."""

    def __init__(self, inner):
        self.inner = inner

    def submit(self, dst, src):
        from concurrent.futures import Future

        from elastic_hf.morph.copier import CopyHandle

        future = Future()
        future.set_exception(RuntimeError("copy failed: injected"))
        handle = CopyHandle(future=future)
        handle.nbytes = src.numel()
        return handle

    def sync_compute(self):
        self.inner.sync_compute()


def test_a_failed_copy_is_cleared_once_and_gives_its_slot_back(model):
    """It was re-raised at every step boundary forever; now the layer stays, the slot's pages go back, the
    failure is counted, and the next request for the layer works."""
    swapper = model.worker.morph.swapper
    placement = model.worker.weights.placement
    arena = model.worker.weights.arena
    weights_before = model.worker.budget.used_bytes("weights")
    inner = swapper.copier
    swapper.copier = FailingCopier(inner)
    try:
        swapper.request(1, "w4")
        swapper.poll()                                   # started (slot committed), failed at once
        assert swapper.poll() == [] and swapper.poll() == []   # cleared once: never raised again
        assert swapper.precision[1] == "fp" and not swapper.busy and swapper.pending_layers() == []
        assert not arena.is_committed(placement.slots[1]["w4"].offset, placement.slots[1]["w4"].nbytes)
        assert model.worker.budget.used_bytes("weights") == weights_before
        assert swapper.counters.num_failed_copies == 1 and "injected" in swapper.counters.last_failure
    finally:
        swapper.copier = inner
    state = model.morph.to_precision(1, "w4")   # a later request for the layer works
    assert state["layer_counts"]["w4"] == 1 and state["num_failed_copies"] == 1
    model.morph.to_precision("all", "fp")


def test_restore_waits_for_live_kv_blocks(tiny_checkpoint):
    model = tiny_morph_model(tiny_checkpoint("llama"), kv_cache_memory=160 << 10)
    original = snapshot(model)
    model.morph.to_precision("all", "w4")
    total = model.worker.pool.num_blocks
    engine = model.instances[0].engine
    # Requests of 12 blocks each (180 prompt + 8 new tokens) hold all but a few blocks: a restore cannot get
    # the blocks it needs without touching live ones.
    for k in range(total // 12):
        engine.add_request(f"hog-{k}", list(range(1 + k, 181 + k)), SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.scheduler.waiting:
        engine.step()
    # and one that leaves 2 free blocks
    rest = model.instances[0].engine.scheduler.kv.num_free - 2
    engine.add_request("hog-rest", list(range(7, 7 + 16 * rest - 8)), SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.scheduler.waiting:
        engine.step()
    free = model.instances[0].engine.scheduler.kv.num_free
    # the fp region, and the headroom once the switch gives the W4 slot back
    placement = model.worker.weights.placement
    missing = (placement.layers[0].nbytes + model.worker.morph.headroom_bytes - placement.slots[0]["w4"].nbytes
               - model.worker.budget.free_bytes)
    assert free < -(-missing // _block_bytes(model))
    state = model.morph.to_precision("all", "fp")
    assert state["pending"] and state["waiting_for_kv_blocks"] and state["layer_counts"]["w4"] == 3
    assert model.instances[0].engine.scheduler.kv.num_free == free   # nothing was detached for a restore that waits
    while engine.has_unfinished_requests():
        engine.step()                                  # the hook retries the restore at every boundary
    assert model.morph.state()["layer_counts"]["fp"] == 3
    assert model.instances[0].engine.scheduler.kv.num_used == 0
    assert_bit_identical(model, original)


def test_bad_layer_and_precision_are_clear_errors(model):
    with pytest.raises(ValueError, match=r"layer 7 does not exist: this model has layers 0..2"):
        model.morph.to_precision([7], "w4")
    with pytest.raises(ValueError, match=r"precision 'int3' is unknown; allowed: fp, w8, w4"):
        model.morph.to_precision("all", "int3")
    with pytest.raises(ValueError, match="morph='fast' is unknown"):
        from elastic_hf import ElasticModel
        ElasticModel.from_pretrained("unused", morph="fast")


def test_images_hold_the_variant_and_modules_view_the_arena(model):
    store = model.worker.morph.swapper.store
    arena = model.worker.weights.arena
    base = arena.view(0, (1,), torch.uint8, require_committed=False).data_ptr()
    for precision in ("w8", "w4"):
        slot = model.worker.weights.placement.slots[0][precision]
        for tensor in list(store.module(0, precision).parameters()) + list(store.module(0, precision).buffers()):
            assert slot.offset <= tensor.data_ptr() - base < slot.offset + slot.nbytes
    report = model.memory_report()["layer_store"]
    assert report["host_bytes"]["fp"] > report["host_bytes"]["w8"] > report["host_bytes"]["w4"] > 0


@pytest.mark.gpu
def test_cuda_swaps_copy_from_pinned_host_on_a_side_stream(tmp_path):
    from elastic_hf import ElasticModel
    from elastic_hf.morph.copier import CudaCopier
    from tiny_models import build_tiny_checkpoint

    # the minimal tokenizer: a GPU machine need not have the default model. Layers of ~13 MiB: a CUDA arena maps
    # 2 MiB pages, and a swap to w4 must give whole pages back.
    checkpoint = build_tiny_checkpoint("llama", tmp_path / "llama", tokenizer="minimal", hidden_size=512,
                                       intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4)
    model = ElasticModel.from_pretrained(checkpoint, device="cuda", kv_cache_memory=8 << 20,
                                         morph="manual", morph_options={"use_cache": False})
    original = snapshot(model)
    swapper = model.worker.morph.swapper
    assert isinstance(swapper.copier, CudaCopier)
    assert swapper.store.image(0, "w4").data.is_pinned() and swapper.store.image(0, "fp").data.is_pinned()
    prompt = list(range(5, 30))
    reference = model.generate(prompt, max_tokens=8, ignore_eos=True).outputs[0].token_ids
    weights_before = model.worker.budget.used_bytes("weights")
    state = model.morph.to_precision("all", "w4")
    assert state["layer_counts"]["w4"] == 3 and model.worker.budget.used_bytes("weights") < weights_before
    assert len(model.generate(prompt, max_tokens=8, ignore_eos=True).outputs[0].token_ids) == 8
    model.morph.to_precision("all", "fp")
    assert_bit_identical(model, original)
    assert model.generate(prompt, max_tokens=8, ignore_eos=True).outputs[0].token_ids == reference


def test_awq_variants_are_cached_and_reload_identically(tiny_checkpoint, tmp_path):
    from elastic_hf import ElasticModel

    calib = tmp_path / "calib.txt"
    calib.write_text("The tower is 324 metres tall, about the same height as an 81-storey building. " * 60)
    options = {"precisions": ("w4",), "cache_dir": str(tmp_path / "cache"), "calib_path": str(calib),
               "calib_samples": 1, "calib_seq_len": 32}
    first = ElasticModel.from_pretrained(tiny_checkpoint("llama"), kv_cache_memory=1 << 20, morph="manual",
                                         morph_options=options)
    files = sorted((tmp_path / "cache").rglob("*.safetensors"))
    assert len(files) == 3 and "w4-g64-awq" in str(files[0])
    second = ElasticModel.from_pretrained(tiny_checkpoint("llama"), kv_cache_memory=1 << 20, morph="manual",
                                          morph_options=options)
    for i in range(3):
        a, b = first.worker.morph.swapper.store.image(i, "w4"), second.worker.morph.swapper.store.image(i, "w4")
        assert torch.equal(a.data, b.data) and a.specs == b.specs
    original = snapshot(second)
    second.morph.to_precision("all", "w4")
    second.morph.to_precision("all", "fp")
    assert_bit_identical(second, original)


def test_stale_variant_cache_is_replaced_without_leftovers(tiny_checkpoint, tmp_path):
    """A cache entry that fails to load is rebuilt and replaced; no temporary directories stay behind."""
    from elastic_hf import ElasticModel

    options = {"precisions": ("w8",), "cache_dir": str(tmp_path / "cache")}
    ElasticModel.from_pretrained(tiny_checkpoint("llama"), kv_cache_memory=1 << 20, morph="manual",
                                 morph_options=options)
    entry = next((tmp_path / "cache").rglob("layer-000.safetensors")).parent
    (entry / "layer-001.safetensors").write_bytes(b"truncated")
    model = ElasticModel.from_pretrained(tiny_checkpoint("llama"), kv_cache_memory=1 << 20, morph="manual",
                                         morph_options=options)
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]
    assert (entry / "layer-001.safetensors").stat().st_size > 1000
    stored = model.worker.morph.swapper.store.image(1, "w8")
    reloaded = ElasticModel.from_pretrained(tiny_checkpoint("llama"), kv_cache_memory=1 << 20, morph="manual",
                                            morph_options=options).worker.morph.swapper.store.image(1, "w8")
    assert torch.equal(stored.data, reloaded.data)


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_architectures_round_trip(tiny_checkpoint, arch):
    """Qwen2 carries q/k/v biases (buffers of the quantized linears), Mistral a sliding window."""
    model = tiny_morph_model(tiny_checkpoint(arch))
    original = snapshot(model)
    prompt = list(range(3, 40))
    reference = model.generate(prompt, max_tokens=8, ignore_eos=True).outputs[0].token_ids
    for precision in ("w8", "w4"):
        model.morph.to_precision("all", precision)
        assert len(model.generate(prompt, max_tokens=8, ignore_eos=True).outputs[0].token_ids) == 8
    model.morph.to_precision("all", "fp")
    assert_bit_identical(model, original)
    assert model.generate(prompt, max_tokens=8, ignore_eos=True).outputs[0].token_ids == reference
