"""The engine on a GPU: greedy tokens against HF generate on the same GPU, with decode steps replayed from CUDA graphs
(model/cuda_graphs.py) and without (enforce_eager); graphs dropped and recaptured when a precision swap replaces a
layer and when a context outgrows the chunk table. Needs CUDA and Triton; the checkpoints carry a minimal tokenizer
so no default model is needed on the GPU machine."""
from __future__ import annotations

import pytest
import torch

from tiny_models import build_tiny_checkpoint

pytestmark = pytest.mark.gpu

MAX_NEW = 24


@pytest.fixture(autouse=True)
def _needs_triton():
    pytest.importorskip("triton")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("gpu") / "llama", tokenizer="minimal",
                                 num_hidden_layers=4, max_position_embeddings=4096)


def _prompts(num: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(num)]


@torch.inference_mode()
def _hf_greedy(checkpoint, dtype, prompts, max_new):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="sdpa").cuda().eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=2)
        outs.append(out[0, len(p):].tolist())
    return outs


def _load(checkpoint, **options):
    from elastic_hf import ElasticModel

    return ElasticModel.from_pretrained(str(checkpoint), device="cuda", kv_cache_memory=64 << 20, **options)


def _greedy(model, prompts, max_new=MAX_NEW):
    return [list(o.outputs[0].token_ids) for o in model.generate(prompts, max_tokens=max_new, ignore_eos=True)]


def _assert_stacked(model, stacked=True):
    """One worker, no morphing: q/k/v and gate/up run as one GEMM each over their stacked weights
    (layers/stacked_linear.py)."""
    from elastic_hf.layers.packed_linear import FusedMemberLinear

    layer = model.worker.loaded.layers[0]
    for linear in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.mlp.gate_proj, layer.mlp.up_proj):
        assert isinstance(linear, FusedMemberLinear) == stacked


def test_fp32_graphs_match_hf_and_eager(checkpoint):
    prompts = _prompts(5, 3, 90)       # 5 decodes replay the graph of batch 8 with 3 padding rows
    want = _hf_greedy(checkpoint, torch.float32, prompts, MAX_NEW)
    with _load(checkpoint, dtype="float32") as model:
        graphs = model.worker.instance.runner.decode_graphs
        assert graphs is not None
        _assert_stacked(model)
        assert _greedy(model, prompts) == want
        # batches shrink as requests finish at different lengths: several padded sizes, one capture each
        mixed = _greedy(model, prompts[:3], 8) + _greedy(model, prompts[3:], MAX_NEW)
        assert mixed == [w[:8] for w in want[:3]] + want[3:]
        assert graphs.num_replays >= 2 * MAX_NEW and 1 <= graphs.num_captures <= len(graphs.sizes)
    with _load(checkpoint, dtype="float32", enforce_eager=True) as eager:
        from elastic_hf.model.cuda_graph_runner import CudaGraphRunner

        assert not isinstance(eager.worker.instance.runner, CudaGraphRunner)   # the plain ModelRunner
        assert _greedy(eager, prompts) == want
    with _load(checkpoint, dtype="float32", packed_weights="off") as unstacked:
        _assert_stacked(unstacked, stacked=False)
        assert _greedy(unstacked, prompts) == want


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_fused_decoder_layers_on_cuda_match_hf(checkpoint, enforce_eager):
    """fused_layers="on" switches the layers to our flat forward on CUDA too (auto keeps it to the CPU until this
    passes on a GPU): eager steps run it, decode graphs capture it; HF's greedy tokens either way."""
    from elastic_hf.layers.fused_decoder_layer import FusedDecoderLayer

    prompts = _prompts(5, 3, 90, seed=6)
    want = _hf_greedy(checkpoint, torch.float32, prompts, MAX_NEW)
    with _load(checkpoint, dtype="float32", fused_layers="on", enforce_eager=enforce_eager) as model:
        layers = model.worker.loaded.layers
        assert all(isinstance(layer, FusedDecoderLayer) for layer in layers)
        assert _greedy(model, prompts) == want
        graphs = getattr(model.worker.instance.runner, "decode_graphs", None)
        assert (graphs is None) == enforce_eager and (enforce_eager or graphs.num_replays >= MAX_NEW - 1)


def test_bf16_graphs_match_hf_up_to_near_ties(checkpoint):
    from elastic_hf.model.loader import load_hf_model
    from greedy_reference import assert_greedy_equal_up_to_ties, hf_greedy_with_logits

    prompts = _prompts(6, 3, 120, seed=1)
    reference, _ = load_hf_model(checkpoint, dtype=torch.bfloat16)
    reference.cuda()
    with _load(checkpoint, dtype="bfloat16") as model:
        outputs = _greedy(model, prompts, 12)
        assert model.worker.instance.runner.decode_graphs.num_replays > 0
    exact = 0
    for prompt, tokens in zip(prompts, outputs):
        want, logits = hf_greedy_with_logits(reference, prompt, 12, device="cuda")
        exact += assert_greedy_equal_up_to_ties(tokens, want, logits)
    assert exact >= len(prompts) // 2, f"only {exact}/{len(prompts)} equal throughout"


def test_graphs_recaptured_after_precision_swap(checkpoint):
    prompts = _prompts(4, 10, 40, seed=2)
    with _load(checkpoint, dtype="float32", morph="manual", morph_options=dict(use_cache=False)) as model:
        graphs = model.worker.instance.runner.decode_graphs
        fp = _greedy(model, prompts)
        captures = graphs.num_captures
        model.morph.to_precision("all", "w8")
        w8 = _greedy(model, prompts)
        assert graphs.num_captures > captures          # the swapped layers are not the captured ones
        model.morph.to_precision("all", "fp")
        assert _greedy(model, prompts) == fp          # back on the full-precision layers, same tokens
    with _load(checkpoint, dtype="float32", morph="manual", morph_options=dict(use_cache=False),
               enforce_eager=True) as eager:
        eager.morph.to_precision("all", "w8")
        assert _greedy(eager, prompts) == w8


def test_context_longer_than_the_table_widens_it(checkpoint, monkeypatch):
    from elastic_hf.model import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "MIN_TABLE_BLOCKS", 2)    # 32 tokens
    short, long = _prompts(3, 4, 10, seed=4), _prompts(3, 40, 100, seed=3)
    want = _hf_greedy(checkpoint, torch.float32, short + long, MAX_NEW)
    with _load(checkpoint, dtype="float32") as model:
        graphs = model.worker.instance.runner.decode_graphs
        assert _greedy(model, short, 8) == [w[:8] for w in want[:3]]   # <= 18 tokens: the 2-block table
        assert graphs.table_blocks == 2 and graphs.num_captures >= 1
        captures = graphs.num_captures
        assert _greedy(model, long) == want[3:]           # outgrows it: a wider table, graphs captured again
        assert graphs.table_blocks >= 8 and graphs.num_captures > captures


def test_chunked_and_windowed_prefills_match_hf(tmp_path):
    """Mistral (a 24-token sliding window) with a 64-token step budget: chunks of longer prompts continue cached
    contexts, windowed prefills and decodes attend with their own masks (and keep their steps eager), short fresh
    ones may group (the grouping itself: tests/kv/test_paged_attention.py and the fp32 test above)."""
    checkpoint = build_tiny_checkpoint("mistral", tmp_path / "mistral", tokenizer="minimal", num_hidden_layers=3)
    prompts = _prompts(6, 5, 150, seed=5)
    want = _hf_greedy(checkpoint, torch.float32, prompts, MAX_NEW)
    with _load(checkpoint, dtype="float32", max_num_batched_tokens=64) as model:
        assert _greedy(model, prompts) == want
