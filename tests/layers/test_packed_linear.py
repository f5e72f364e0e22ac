"""oneDNN prepacked linear weights (layers/packed_linear.py, PlacedWeights.pack_linears): bf16 results bit-identical
to F.linear, an engine with packed weights gives the unpacked engine's (and HF's) greedy tokens, the plain weights'
pages really go back (ledger and RSS), a tied LM head keeps its table and counts its packed copy, and the
deployments whose weights change after load never pack."""
import pytest
import torch
from torch import nn

from elastic_hf import ElasticModel
from elastic_hf.config import EngineConfig
from elastic_hf.layers.packed_linear import PackedLinear, pack_linear, packing_available, takes_packing
from elastic_hf.model.loader import load_hf_model
from elastic_hf.parallel.worker import rss_anon_bytes
from greedy_reference import hf_greedy, mixed_prompts

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch build without oneDNN weight packing")

MAX_NEW = 10


@pytest.mark.parametrize("shape", [(1, 576), (4, 576), (1, 32, 576), (3, 17, 576)])
def test_packed_bf16_is_bit_identical_and_fp32_close(shape):
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        linear = nn.Linear(576, 1536).to(dtype)
        x = torch.randn(*shape).to(dtype)
        expected = linear(x)
        assert takes_packing(linear) and pack_linear(linear) == linear.weight.numel() * linear.weight.element_size()
        assert type(linear) is PackedLinear
        got = linear(x)
        if dtype == torch.bfloat16:
            assert torch.equal(got, expected)
        else:   # another GEMM kernel: equal up to float rounding
            assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_which_linears_pack():
    assert takes_packing(nn.Linear(64, 64).to(torch.bfloat16))           # bf16: every size gains
    assert not takes_packing(nn.Linear(576, 192))                          # small fp32: ATen is faster
    assert takes_packing(nn.Linear(576, 576))
    assert not takes_packing(nn.Linear(576, 576).to(torch.float16))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tiny_models import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("packed")
    # fp32 packs only weights of >= 576*576 elements: a wide MLP so that the decoder layers pack too.
    shapes = dict(hidden_size=256, intermediate_size=1536, num_hidden_layers=3)
    return {tied: build_tiny_checkpoint("llama", root / f"tied{tied}", 0, tie_word_embeddings=tied, **shapes)
            for tied in (False, True)}


def _packed_modules(model):
    return [m for m in model.worker.hf_model.modules() if type(m) is PackedLinear]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True])
def test_engine_on_packed_weights_keeps_greedy_tokens_and_memory(checkpoints, dtype, tied):
    path = checkpoints[tied]
    ref, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 6, 5, 60, seed=3)
    runs, reports = {}, {}
    for mode in ("off", "auto"):
        with ElasticModel.from_pretrained(path, dtype=dtype, packed_weights=mode, kv_cache_memory=4 << 20,
                                          max_num_batched_tokens=64) as model:
            runs[mode] = [o.outputs[0].token_ids for o in model.generate(prompts, max_tokens=MAX_NEW)]
            reports[mode] = model.memory_report()
            packed = _packed_modules(model)
            if mode == "off":
                assert not packed
                continue
            # fp32: gate/up/down and the head (q/k/v/o are below the oneDNN size rule); bf16: every linear.
            assert len(packed) == (3 * 3 + 1 if dtype == "float32" else 3 * 7 + 1)
            head = model.worker.hf_model.lm_head
            embed = model.worker.hf_model.model.embed_tokens
            for m in packed:   # the plain weights gave their pages back, but a tied head's table is the embedding
                assert m.weight.device.type == ("cpu" if m is head and tied else "meta")
            assert (head.weight is embed.weight) == tied
            page = model.worker.instance.page_size
            head_bytes = head.packed_weight.numel() * head.packed_weight.element_size()
            # The ledger adds up: what the arena still commits plus every packed weight.
            packed_bytes = sum(m.packed_weight.numel() * m.packed_weight.element_size() for m in packed)
            assert reports[mode]["weights_bytes"] == model.worker.instance.weights.arena.committed_bytes + packed_bytes
    assert runs["auto"] == runs["off"]
    if dtype == "float32":
        assert runs["auto"] == [hf_greedy(ref, p, MAX_NEW) for p in prompts]
    # Same KV either way; the weights cost what they did (a page at each end of a layer's packed run stays), plus
    # the packed copy of a tied head.
    assert reports["auto"]["kv_blocks"] == reports["off"]["kv_blocks"]
    extra = reports["auto"]["weights_bytes"] - reports["off"]["weights_bytes"] - (head_bytes if tied else 0)
    assert 0 <= extra <= 2 * page * 4, extra


def test_packing_gives_the_plain_pages_back_to_the_os(checkpoints):
    """RSS after packing grows by far less than the packed bytes: the arena pages under the plain weights went
    back (without the decommit it would grow by all of them)."""
    with ElasticModel.from_pretrained(checkpoints[False], packed_weights="off", kv_cache_memory=4 << 20) as model:
        weights = model.worker.instance.weights
        ledger = model.memory_report()["weights_bytes"]
        before = rss_anon_bytes()
        assert weights.pack_linears(model.worker.hf_model) == 10
        grown = rss_anon_bytes() - before
        packed = sum(m.packed_weight.numel() * m.packed_weight.element_size() for m in _packed_modules(model))
        assert packed > 16 << 20 and grown < 0.25 * packed, (grown, packed)
        assert 0 <= model.memory_report()["weights_bytes"] - ledger <= 8 * weights.arena.page_size


def test_deployments_whose_weights_change_never_pack():
    assert EngineConfig().packs_weights
    assert not EngineConfig(num_workers=2).packs_weights
    assert not EngineConfig(morph="manual").packs_weights
    assert not EngineConfig(packed_weights="off").packs_weights
    with pytest.raises(ValueError, match="num_workers is 2"):
        EngineConfig(num_workers=2, packed_weights="on")
    with pytest.raises(ValueError, match="morph='manual'"):
        EngineConfig(morph="manual", packed_weights="on")
    with pytest.raises(ValueError, match=r"packed_weights must be one of \('auto', 'on', 'off'\), got 'yes'"):
        EngineConfig(packed_weights="yes")
