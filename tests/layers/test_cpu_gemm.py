import pytest
import torch
from torch import nn

from elastic_hf.layers.cpu_gemm import MIN_ONEDNN_NUMEL, OneDnnLinear, onednn_available, use_onednn_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch build without oneDNN")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({
        "big": nn.Linear(576, 1536),                # >= threshold: switches
        "square": nn.Linear(576, 576, bias=False),  # exactly the threshold: switches
        "small": nn.Linear(576, 192),               # below: stays on ATen
        "bf16": nn.Linear(576, 1536).to(torch.bfloat16),
    })


def test_switches_only_large_fp32_linears_and_keeps_parameters():
    model = _model()
    params = {name: module.weight for name, module in model.items()}
    assert use_onednn_linears(model, backend="onednn") == 2
    assert type(model["big"]) is OneDnnLinear and type(model["square"]) is OneDnnLinear
    assert type(model["small"]) is nn.Linear and type(model["bf16"]) is nn.Linear
    assert model["square"].weight.numel() == MIN_ONEDNN_NUMEL
    for name, module in model.items():
        assert module.weight is params[name]  # same Parameter object: arena views and morph bindings survive


@pytest.mark.parametrize("shape", [(1, 576), (1, 32, 576), (3, 17, 576)])
def test_onednn_linear_matches_aten(shape):
    model = _model()
    x = torch.randn(*shape)
    expected = {name: model[name](x) for name in ("big", "square")}
    use_onednn_linears(model, backend="onednn")
    for name, reference in expected.items():
        got = model[name](x)
        assert got.shape == reference.shape
        # different GEMM kernels: equal up to float rounding (measured ~1e-6 relative)
        assert (got - reference).abs().max() <= 1e-5 * reference.abs().max()


def test_aten_backend_and_env_override(monkeypatch):
    assert use_onednn_linears(_model(), backend="aten") == 0
    monkeypatch.setenv("ELASTIC_HF_CPU_GEMM", "aten")
    assert use_onednn_linears(_model()) == 0
    monkeypatch.setenv("ELASTIC_HF_CPU_GEMM", "blas")
    with pytest.raises(ValueError, match="ELASTIC_HF_CPU_GEMM='blas' is not one of onednn, aten"):
        use_onednn_linears(_model())


def test_default_model_linears_run_on_onednn(default_model):
    """The engine's model computes every projection and the LM head with oneDNN on prepacked weights (a single
    worker without morphing: layers/packed_linear.py): q/k/v as one fused GEMM (the small K/V projections alone
    would stay on ATen), gate/up as another."""
    kinds = {}
    for name, module in default_model.worker.hf_model.named_modules():
        if isinstance(module, nn.Linear):
            kinds.setdefault(type(module).__name__, set()).add(name.rsplit(".", 1)[-1])
    assert kinds == {"PackedLinear": {"o_proj", "down_proj", "lm_head"},
                     "FusedMemberLinear": {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}}


def test_fp32_linear_follows_the_same_rule(monkeypatch):
    """fp32_linear (tensor-parallel shards) takes oneDNN for the same weights use_onednn_linears switches; the
    calls are observed, not inferred from timings."""
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    class _Spy:
        def __getattr__(self, name):
            if name == "_linear_pointwise":
                return lambda *a: calls.append(a[1].shape) or real(*a)
            return getattr(torch.ops.mkldnn, name)

    import elastic_hf.layers.cpu_gemm as cpu_gemm

    monkeypatch.setattr(cpu_gemm.torch.ops, "mkldnn", _Spy(), raising=False)
    x = torch.randn(5, 576)
    big, small = torch.randn(1536, 576), torch.randn(192, 576)
    torch.testing.assert_close(cpu_gemm.fp32_linear(x, big), x @ big.t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_gemm.fp32_linear(x, small), x @ small.t(), rtol=1e-5, atol=1e-4)
    assert calls == [(1536, 576)]
    monkeypatch.setenv("ELASTIC_HF_CPU_GEMM", "aten")
    cpu_gemm.fp32_linear(x, big)
    assert calls == [(1536, 576)]
