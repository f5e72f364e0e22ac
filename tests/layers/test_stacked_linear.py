"""Stacked linears (layers/stacked_linear.py, PlacedWeights.stack_linears): a layer's q/k/v and gate/up, placed back
to back by the weights arena, run as one GEMM each over a view of their own bytes (no copy, no memory change), the
model computes what it did, HF's forward makes one product call per group, and groups whose weights are not
adjacent (biases between them) keep their linears. CUDA uses it by default (EngineConfig.packed_weights); the CPU
runs the same code here, and tests/model/test_cuda_graphs.py checks it inside decode graphs on a GPU."""
import pytest
import torch
from torch import nn

from elastic_hf.config import EngineConfig
from elastic_hf.layers.packed_linear import FusedMemberLinear
from elastic_hf.layers.stacked_linear import stack_fused, stackable
from elastic_hf.memory import MemoryBudget
from elastic_hf.model.weight_placement import PlacedWeights
from tiny_models import tiny_hf_model


def _placed(arch: str):
    model = tiny_hf_model(arch, 0, num_hidden_layers=2)
    layers = model.model.layers
    weights = PlacedWeights.place(model, layers, MemoryBudget(1 << 30), torch.device("cpu"), 4096)
    groups = [[layer.get_submodule(n) for n in names] for layer in layers
              for names in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                            ("mlp.gate_proj", "mlp.up_proj"))]
    return model, weights, groups


def _count_linear_calls(monkeypatch) -> list[int]:
    calls = [0]
    linear = nn.functional.linear

    def counted(*args, **kwargs):
        calls[0] += 1
        return linear(*args, **kwargs)

    monkeypatch.setattr(nn.functional, "linear", counted)
    return calls


@torch.inference_mode()
def test_stacked_groups_compute_the_same_with_one_gemm_each_and_no_new_memory(monkeypatch):
    model, weights, groups = _placed("llama")
    ids = torch.randint(3, 500, (1, 12))
    expected = model(ids).logits
    committed = weights.committed_bytes
    q = groups[0][0]
    q_ptr = q.weight.data_ptr()
    assert all(stackable(g) for g in groups)
    assert weights.stack_linears(groups) == len(groups) == 4
    assert all(type(m) is FusedMemberLinear for g in groups for m in g)
    product = q.fused
    assert product.packed_weight.data_ptr() == q_ptr and not product.packed   # a view of q's own bytes on
    assert product.packed_weight.shape == (sum(m.out_features for m in groups[0]), q.in_features)
    assert weights.committed_bytes == committed
    calls = _count_linear_calls(monkeypatch)
    got = model(ids).logits
    # per layer q/k/v, o, gate/up, down: 4 GEMMs instead of 7; plus the LM head
    assert calls[0] == 2 * 4 + 1
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert q.fused._output is None   # every member read the product: nothing held past the layer


def test_linears_with_biases_between_them_are_not_stacked():
    """Qwen2's q/k/v have biases (placed between the weights): they keep three GEMMs; its gate/up stack."""
    model, weights, groups = _placed("qwen2")
    qkv, gate_up = groups[0], groups[1]
    assert not stackable(qkv) and stackable(gate_up)
    assert weights.stack_linears(groups) == 2
    assert type(qkv[0]) is nn.Linear and type(gate_up[0]) is FusedMemberLinear


def test_a_stacked_weight_must_be_a_view_from_the_first_member():
    _, weights, groups = _placed("llama")
    gate, up = groups[1]
    with pytest.raises(ValueError, match=r"must be a \[\d+, \d+\] torch.float32 view"):
        stack_fused([gate, up], torch.empty(gate.out_features + up.out_features, gate.in_features))


def test_cuda_deployments_of_one_worker_without_morphing_stack():
    assert EngineConfig(device="cuda").packs_weights
    assert not EngineConfig(device="cuda", morph="manual").packs_weights
    assert not EngineConfig(device="cuda", packed_weights="off").packs_weights


def test_an_engine_without_onednn_packing_stacks_and_keeps_hfs_greedy_tokens(tiny_checkpoint, monkeypatch):
    """Where oneDNN cannot pack (ATen GEMMs forced here; bf16 on an AVX2-only CPU), a single worker still runs
    q/k/v and gate/up as one GEMM each, the MLP's silu(gate) * up straight from the product: HF's greedy tokens."""
    from elastic_hf import ElasticModel
    from elastic_hf.layers.swiglu_mlp import SwiGLUMLP
    from elastic_hf.model.loader import load_hf_model
    from greedy_reference import hf_greedy, mixed_prompts

    monkeypatch.setenv("ELASTIC_HF_CPU_GEMM", "aten")
    path = tiny_checkpoint("llama")
    ref, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 4, 5, 40, seed=7)
    with ElasticModel.from_pretrained(path, kv_cache_memory=4 << 20, max_num_batched_tokens=32) as model:
        layer = model.worker.loaded.layers[0]
        assert type(layer.self_attn.q_proj) is FusedMemberLinear and not layer.self_attn.q_proj.fused.packed
        assert type(layer.mlp) is SwiGLUMLP
        tokens = [list(o.outputs[0].token_ids) for o in model.generate(prompts, max_tokens=8)]
    assert tokens == [hf_greedy(ref, p, 8) for p in prompts]
