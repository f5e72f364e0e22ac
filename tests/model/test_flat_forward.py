"""The flat model forward (model/flat_forward.py): for Llama, Qwen2 and Mistral models whose layers are all switched it
replaces HF's two model forwards, and the engine's logits equal those of the same engine on HF's forwards bit for
bit, in prefill, mixed and decode steps, fp32 and bf16, with lean runs of layers (layers/lean_decode.py: the layers a
run computed are not called); a forward hook on the model, or a layer not switched, gives HF's forward back, and a
lean run then passes its output through HF's loop."""
import pytest
import torch

from elastic_hf import ElasticModel
from elastic_hf.layers import lean_decode
from elastic_hf.model import flat_forward
from elastic_hf.model.loader import load_hf_model
from greedy_reference import mixed_prompts, step_logits

MAX_NEW = 8


def _runner(model):
    return model.worker.instance.runner


def _flat_calls(monkeypatch) -> list[int]:
    """Counts the flat forward's steps."""
    calls, call = [], flat_forward.FlatForward.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(flat_forward.FlatForward, "__call__", counted)
    return calls


def _compare(path, prompts, monkeypatch, hook: bool = False, counters: tuple[list, ...] = (), **options) -> list[int]:
    """Steps' logits on HF's forward and on the flat one (or, with `hook`, with a hook on the model that turns the
    flat one off): equal bit for bit. Returns the flat forward's steps; `counters` are emptied before the second."""
    logits = {}
    calls = _flat_calls(monkeypatch)
    for flat in (False, True):   # a model each: the second run would hit the first's prefix cache
        for counter in counters:
            counter.clear()
        with ElasticModel.from_pretrained(path, kv_cache_memory=8 << 20, max_num_batched_tokens=32,
                                          **options) as model:
            runner = _runner(model)
            assert runner.flat_forward is not None
            if not flat:
                runner.flat_forward = None
            elif hook:
                model.worker.loaded.hf_model.register_forward_hook(lambda *args: None)
            logits[flat] = step_logits(model, prompts, MAX_NEW)
    assert len(logits[False]) == len(logits[True]) > MAX_NEW
    for a, b in zip(logits[False], logits[True]):
        assert torch.equal(a, b)
    return calls


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("qwen2", "bfloat16"), ("mistral", "float32")])
def test_the_flat_forward_gives_hfs_logits_bit_for_bit(tiny_checkpoint, arch, dtype, monkeypatch):
    path = tiny_checkpoint(arch)
    _, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 4, 3, 40, seed=11)
    calls = _compare(path, prompts, monkeypatch, dtype=dtype)
    assert len(calls) > MAX_NEW   # every step of the second model: prefills, mixed steps and decodes


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """Layers wide enough that the lean decode path reads them (every linear packed), three so that a run has two
    followers."""
    from tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("flat") / "wide", 0, hidden_size=576,
                                 intermediate_size=1536, num_hidden_layers=3, num_attention_heads=9,
                                 num_key_value_heads=3)


def _lean_runs(monkeypatch) -> list[int]:
    """The length of every lean run (the layers computed after the one called)."""
    lengths, run_after = [], lean_decode._run_after

    def recorded(*args):
        run = run_after(*args)
        lengths.append(len(run))
        return run

    monkeypatch.setattr(lean_decode, "_run_after", recorded)
    return lengths


@pytest.mark.parametrize("hook", [False, True])
def test_lean_runs_skip_or_pass_through_the_layers_they_computed(wide_llama, hook, monkeypatch):
    """Decode steps compute all three layers in one C call: the flat forward does not call the other two, HF's loop
    (a hook on the model turns the flat forward off) calls them and they pass the output through."""
    _, tokenizer = load_hf_model(wide_llama)
    prompts = mixed_prompts(tokenizer, 4, 3, 40, seed=12)
    lengths = _lean_runs(monkeypatch)
    passed, pass_through = [], lean_decode._pass_through
    monkeypatch.setattr(lean_decode, "_pass_through", lambda *args: passed.append(1) or pass_through(*args))
    with ElasticModel.from_pretrained(wide_llama, dtype="bfloat16", kv_cache_memory=8 << 20) as model:
        if getattr(model.worker.loaded.layers[0].self_attn.q_proj, "fused", None) is None:
            pytest.skip("this CPU's bf16 linears are not read by native/decode_gemm.c")
    calls = _compare(wide_llama, prompts, monkeypatch, hook=hook, counters=(lengths, passed), dtype="bfloat16")
    assert len(lengths) >= MAX_NEW - 2 and set(lengths) == {2}        # runs of the decode steps: layers 0, 1, 2
    assert (len(calls) == 0) == hook                                   # the hook turned the flat forward off
    assert len(passed) == (2 * len(lengths) if hook else 0)            # HF's loop called layers 1, 2: passed through
