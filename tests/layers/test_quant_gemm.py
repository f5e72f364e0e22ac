"""native/quant_gemm.c behind W8Linear on the CPU: products equal the dequantized fp32 reference (fp32 to float
rounding, bf16 to one output rounding) at decode row counts (direct path), prefill row counts (widened-panel path)
and more rows than one pass; the layer keeps the blocked layout and the plain form in its state dict, so a variant
saved by a blocked layer loads into an aten-path layer and back with the same products."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from elastic_hf.layers.quant_linear import empty_quant_linear, quantize_linear
from elastic_hf.layers.quant_scheme import QuantScheme, dequantize_w4, dequantize_w8, quantize_w4, quantize_w8
from elastic_hf.layers.w4_linear import W4Linear
from elastic_hf.layers.w8_linear import W8Linear
from elastic_hf.native import quant_gemm as wg

pytestmark = pytest.mark.skipif(not wg.quant_gemm_supports(64, 16, "cpu"), reason="no AVX-512 or AVX2 + FMA (or native kernels off)")

W8 = QuantScheme.create("w8")


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _w8(n, k, group_size):
    q, scales = quantize_w8(torch.randn(n, k) * 0.05)
    blocked = wg.w8_to_blocked(q)
    assert blocked.shape == (n // 64, k // 16, 16, 64) and torch.equal(wg.w8_from_blocked(blocked), q)
    return dequantize_w8(q, scales), blocked, {"scales": scales}


def _w4(n, k, group_size):
    q, scales, zeros = quantize_w4(torch.randn(n, k) * 0.05, group_size)
    blocked = wg.w4_to_blocked(q)
    assert blocked.shape == (n // 64, k // 16, 16, 32) and torch.equal(wg.w4_from_blocked(blocked), q)
    sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()   # [groups, n, 2], aten's layout
    return dequantize_w4(q, scales, zeros, group_size), blocked, {"scales_and_zeros": sz, "group_size": group_size}


@pytest.mark.parametrize("quantize", [_w8, _w4])
@pytest.mark.parametrize("n,k,group_size", [(576, 576, 64), (192, 1536, 128), (128, 64, 32), (64, 16, 16)])
def test_products_equal_the_dequantized_reference(quantize, n, k, group_size):
    torch.manual_seed(n + k)
    reference, blocked, params = quantize(n, k, group_size)   # reference [n, k] fp32
    bias = torch.randn(n)
    # 1-13: decode batches (every row-tile size; 13 rows take the panel path), 64 and 300: prefill (300: more rows
    # than one pass of the kernel, ROW_CHUNK = 256)
    for rows in (1, 2, 5, 6, 7, 12, 13, 64, 300):
        x = torch.randn(rows, k)
        for b in (None, bias):
            expected = F.linear(x, reference, b)
            got = wg.quant_gemm(x, blocked, b, **params)
            assert got.shape == (rows, n) and got.dtype == torch.float32
            assert _rel(got, expected) < 1e-5, (rows, b is None)
            xb = x.bfloat16()
            got_bf16 = wg.quant_gemm(xb, blocked, b, **params)
            assert got_bf16.dtype == torch.bfloat16
            # the fp32 product of the bf16 input, rounded once to bf16
            assert _rel(got_bf16, F.linear(xb.float(), reference, b)) < 8e-3, rows


def test_leading_dims_strided_rows_and_no_rows():
    torch.manual_seed(1)
    reference, blocked, params = _w8(128, 64, None)
    wide = torch.randn(3, 5, 100)
    x = wide[..., 10:74]                                      # [3, 5, 64], rows 100 apart
    assert _rel(wg.quant_gemm(x, blocked, None, **params), F.linear(x, reference)) < 1e-5
    assert wg.quant_gemm(torch.randn(0, 64), blocked, None, **params).shape == (0, 128)
    with pytest.raises(ValueError, match="x has 32 features, the weight 64"):
        wg.quant_gemm(torch.randn(2, 32), blocked, None, **params)
    with pytest.raises(TypeError, match="fp32 or bf16 activations, got torch.float16"):
        wg.quant_gemm(torch.randn(2, 64).half(), blocked, None, **params)


@pytest.mark.parametrize("scheme", [W8, QuantScheme.create("w4", 64)])
def test_layer_runs_the_kernel_and_saves_the_portable_form(scheme, monkeypatch):
    torch.manual_seed(2)
    linear = nn.Linear(256, 192, bias=True)
    layer = quantize_linear(linear, scheme)
    module = "w8_linear" if scheme.quant == "w8" else "w4_linear"
    weight = layer.qweight if scheme.quant == "w8" else layer.weight_packed
    assert layer.blocked and weight.shape == ((3, 16, 16, 64) if scheme.quant == "w8" else (3, 16, 16, 32))
    x = torch.randn(9, 256)
    calls = []
    monkeypatch.setattr(f"elastic_hf.layers.{module}.quant_gemm",
                        lambda *a, **kw: calls.append(a) or wg.quant_gemm(*a, **kw))
    y = layer(x)
    assert len(calls) == 1
    assert _rel(y, F.linear(x, layer.dequantized_weight(), linear.bias)) < 1e-5
    assert _rel(layer(x.bfloat16()), y) < 1e-2 and layer(x.half()).dtype == torch.float16

    state = layer.state_dict()
    if scheme.quant == "w8":
        assert state["qweight"].shape == (192, 256) and state["qweight"].dtype == torch.int8
    else:
        assert state["qweight"].shape == (192, 128) and state["qweight"].dtype == torch.uint8
    monkeypatch.setenv(wg.ENV_VAR, "0")                      # a machine without the kernel: aten's layout
    plain = empty_quant_linear(256, 192, True, scheme)
    assert not plain.blocked
    plain.load_state_dict(state, strict=True)
    assert torch.equal(plain.dequantized_weight(), layer.dequantized_weight())
    assert plain.nbytes == layer.nbytes
    assert _rel(plain(x), y) < 2e-2                           # aten casts activations to bf16
    monkeypatch.delenv(wg.ENV_VAR)
    again = empty_quant_linear(256, 192, True, scheme)
    again.load_state_dict(plain.state_dict(), strict=True)
    assert again.blocked and torch.equal(again(x), y)


def test_shapes_it_cannot_read_keep_aten():
    layer = quantize_linear(nn.Linear(64, 96), W8)            # 96 outputs: not whole 64-output blocks
    assert not layer.blocked and layer.qweight.shape == (96, 64)
    x = torch.randn(3, 64)
    assert _rel(layer(x), F.linear(x, layer.dequantized_weight(), layer.bias)) < 2e-2
    assert not W4Linear(64, 96, 32, has_bias=False).blocked and W4Linear(64, 128, 32, has_bias=False).blocked
    with pytest.raises(RuntimeError, match=r"expected int8 \(192, 256\), got torch.int8 \(192, 128\)"):
        W8Linear(256, 192, False).load_state_dict({"qweight": torch.zeros(192, 128, dtype=torch.int8),
                                                   "scales": torch.ones(192)})
