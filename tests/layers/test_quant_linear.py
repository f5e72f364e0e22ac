"""W8/W4 QuantLinear: accuracy vs fp32, kernel vs dequantized reference, bias, state dict, bytes, bad arguments.

Measured relative errors ||y_q - y|| / ||y|| (torch 2.13 CPU, seed 0); bounds leave ~25 % headroom:
  random N(0,1) weights, x ~ N(0,1):   w8 <= 0.0083   w4-g32 <= 0.079   w4-g64 <= 0.090   w4-g128 <= 0.102
  default model weights (layers 0/5/15/29, real activations): w8 <= 0.0085, w4-g64 <= 0.082
  (w4-g32 is exact on the default model: its fp32 weights are de-quantized GGUF Q4_1, the same g32 grid).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from elastic_hf.layers.quant_linear import empty_quant_linear, quantize_linear, reference_linear
from elastic_hf.layers.quant_scheme import QuantScheme
from elastic_hf.layers.w4_linear import W4Linear, pack_int4, unpack_int4

RANDOM_BOUNDS = {("w8", None): 0.011, ("w4", 32): 0.10, ("w4", 64): 0.115, ("w4", 128): 0.13}
REAL_BOUNDS = {("w8", None): 0.012, ("w4", 64): 0.11}
KERNEL_VS_REFERENCE = 1e-2  # bf16 activations at the kernel boundary (layers/kernel_dtype.py): ~4e-3 measured


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("quant,group_size", list(RANDOM_BOUNDS))
@pytest.mark.parametrize("out_features,in_features", [(576, 576), (192, 512), (576, 1536)])
def test_random_weights_within_bound(quant, group_size, out_features, in_features):
    if group_size and in_features % group_size:
        pytest.skip(f"group_size={group_size} does not divide {in_features}")
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False)
    linear.weight.data.normal_()
    x = torch.randn(3, 5, in_features)  # [batch, seq, in]: the layer keeps leading dims
    layer = quantize_linear(linear, QuantScheme.create(quant, group_size))
    y = layer(x)
    assert y.shape == (3, 5, out_features) and y.dtype == torch.float32
    assert rel_err(y, linear(x)) < RANDOM_BOUNDS[(quant, group_size)]
    assert rel_err(y, reference_linear(layer)(x)) < KERNEL_VS_REFERENCE


@pytest.mark.parametrize("scheme", [QuantScheme.create("w8"), QuantScheme.create("w4", 32)])
def test_bias_and_single_token(scheme):
    torch.manual_seed(1)
    linear = nn.Linear(64, 96, bias=True)
    linear.bias.data.normal_(0, 3.0)  # Qwen2-like q/k/v bias, large so a dropped bias would be obvious
    layer = quantize_linear(linear, scheme)
    x = torch.randn(1, 64)  # decode: M = 1
    assert rel_err(layer(x), linear(x)) < 0.05
    assert torch.allclose(layer.bias, linear.bias)


def test_kernels_are_used_not_dense_weights():
    layer = quantize_linear(nn.Linear(64, 32), QuantScheme.create("w4", 32))
    assert not any(t.dtype.is_floating_point and t.shape == (32, 64) for t in layer.buffers())
    assert layer.weight_packed.dtype == torch.uint8
    w8 = quantize_linear(nn.Linear(64, 32), QuantScheme.create("w8"))
    assert w8.qweight.dtype == torch.int8


def test_bf16_activations_on_cpu():
    torch.manual_seed(2)
    linear = nn.Linear(128, 64)
    for scheme in (QuantScheme.create("w8"), QuantScheme.create("w4", 64)):
        layer = quantize_linear(linear, scheme)
        x = torch.randn(4, 128)
        y = layer(x.bfloat16())
        assert y.dtype == torch.bfloat16
        assert rel_err(y, layer(x)) < 0.02  # bf16 rounding of activations and scales


@pytest.mark.parametrize("out_features,in_features", [(96, 64), (576, 1536)])
def test_int4_pack_roundtrip(out_features, in_features):
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32)
    assert torch.equal(unpack_int4(pack_int4(q, torch.device("cpu")), out_features, in_features), q)


@pytest.mark.parametrize("scheme", [QuantScheme.create("w8"), QuantScheme.create("w4", 32),
                                    QuantScheme.create("w4", 64)])
def test_state_dict_roundtrip(scheme):
    torch.manual_seed(3)
    linear = nn.Linear(128, 96, bias=True)
    layer = quantize_linear(linear, scheme)
    state = layer.state_dict()
    if scheme.quant == "w4":
        # portable form, not the ISA-specific kernel layout
        assert set(state) == {"qweight", "scales_and_zeros", "bias"}
        assert state["qweight"].dtype == torch.uint8 and state["qweight"].shape == (96, 64)
        q, _, _ = layer.quantized_values()
        assert torch.equal(state["qweight"] & 15, q[:, ::2].to(torch.uint8))
    fresh = empty_quant_linear(128, 96, True, scheme)
    fresh.load_state_dict(state, strict=True)
    x = torch.randn(7, 128)
    assert torch.equal(fresh(x), layer(x))


def test_nbytes():
    linear = nn.Linear(576, 1536, bias=False)
    w4 = quantize_linear(linear, QuantScheme.create("w4", 64))
    w8 = quantize_linear(linear, QuantScheme.create("w8"))
    assert w4.nbytes == 1536 * 576 // 2 + (576 // 64) * 1536 * 2 * 4  # nibbles + fp32 (scale, zero) per group
    assert w8.nbytes == 1536 * 576 + 1536 * 4
    fp32_bytes = 1536 * 576 * 4
    assert fp32_bytes / w4.nbytes > 6.0 and fp32_bytes / w8.nbytes > 3.9


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"quant='w3'.*allowed: w8, w4"):
        QuantScheme.create("w3")
    with pytest.raises(ValueError, match=r"method='gptq'.*allowed: rtn, awq"):
        QuantScheme.create("w4", 64, "gptq")
    with pytest.raises(ValueError, match=r"group_size=48 .*allowed: 32, 64, 128"):
        QuantScheme.create("w4", 48)
    with pytest.raises(ValueError, match=r"group_size=128 does not divide the input dimension 576.*allowed.*32, 64"):
        quantize_linear(nn.Linear(576, 64), QuantScheme.create("w4", 128))
    with pytest.raises(ValueError, match=r"group_size=128 does not divide the input dimension 576"):
        W4Linear(576, 64, 128, has_bias=False)


@pytest.mark.slow
def test_default_model_weights_within_bound(hf_default_model, wikitext_path):
    model, tokenizer, _ = hf_default_model
    text = wikitext_path.read_text()[:4000]
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :128]
    with torch.no_grad():
        hidden_states = model(ids, output_hidden_states=True).hidden_states
        for index in (0, 15, 29):
            layer = model.model.layers[index]
            x = layer.input_layernorm(hidden_states[index][0])  # [tokens, hidden] real activations
            x_mlp = torch.randn(16, 1536) * 0.1
            for (quant, group_size), bound in REAL_BOUNDS.items():
                scheme = QuantScheme.create(quant, group_size)
                for name, inputs in (("self_attn.q_proj", x), ("self_attn.k_proj", x), ("mlp.up_proj", x),
                                     ("mlp.down_proj", x_mlp)):
                    linear = layer.get_submodule(name)
                    err = rel_err(quantize_linear(linear, scheme)(inputs), linear(inputs))
                    assert err < bound, f"layer {index} {name} {scheme.name}: {err:.4f} >= {bound}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernels_match_reference():
    torch.manual_seed(4)
    linear = nn.Linear(576, 1536, bias=True).cuda()
    x = torch.randn(16, 576, device="cuda")
    for scheme in (QuantScheme.create("w8"), QuantScheme.create("w4", 64)):
        layer = quantize_linear(linear, scheme)
        y = layer(x)
        assert y.dtype == torch.float32
        assert rel_err(y, reference_linear(layer)(x)) < 1e-2  # bf16 activations at the kernel boundary
        state = layer.state_dict()
        cpu_layer = empty_quant_linear(576, 1536, True, scheme, "cpu")
        cpu_layer.load_state_dict({k: v.cpu() for k, v in state.items()})
        assert rel_err(cpu_layer(x.cpu()), y.cpu()) < 1e-2
