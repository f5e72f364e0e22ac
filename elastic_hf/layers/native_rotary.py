"""HF's rotary embedding (`apply_rotary_pos_emb` of the architecture's modeling module) on the native one-pass
kernel (native/rotary.c) for CPU fp32 and bf16 tensors. Eager torch spends ~12 ops over strided views on it per
layer: at a 2,048-token prefill 2.7 ms a layer in bf16 and ~1 ms in fp32 on the 2-core test machine (bf16: more
than the layer's attention).

HF's attention forward calls the function by its module-global name, so the function is wrapped where it lives,
once per process, like the modules of native_norm.py are switched where they sit. The wrapper is bit-identical to
the original (tests/layers/test_native_rotary.py compares them bit for bit), so a plain HF model of the same
architecture in the same process computes exactly what it computed before; whatever the kernel does not take (fp16
on the CPU, a batch of several rows, another unsqueeze_dim, autograd) goes to the original. CUDA tensors go to the
Triton version of the kernel (native/triton_elementwise.py) where Triton is installed."""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

from elastic_hf.native import triton_elementwise
from elastic_hf.native.rotary import apply_rotary, native_rotary_available


def _takes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> bool:
    """The packed-batch layout the engine hands over: q [1, heads, T, hd], k [1, kv_heads, T, hd], cos and sin
    [1, T, hd] of one dtype on the CPU, head_dim contiguous everywhere."""
    if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
        return False
    _, _, tokens, head_dim = q.shape
    return (q.shape[0] == k.shape[0] == 1 and k.shape[2:] == q.shape[2:] and head_dim % 2 == 0
            and cos.shape == sin.shape == (1, tokens, head_dim) and cos.stride() == sin.stride()
            and q.dtype == k.dtype == cos.dtype == sin.dtype
            and q.stride(3) == k.stride(3) == cos.stride(2) == 1
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
            and _kernel_for(q.dtype, q.device) is not None)


def _kernel_for(dtype: torch.dtype, device: torch.device) -> Callable | None:
    """The one-pass rotary for this dtype on this device (C on the CPU, Triton on CUDA), or None."""
    if device.type == "cpu":
        return apply_rotary if native_rotary_available(dtype, device) else None
    if device.type == "cuda" and triton_elementwise.triton_elementwise_available(dtype, device):
        return triton_elementwise.apply_rotary
    return None


def _native_version(eager: Callable) -> Callable:
    @functools.wraps(eager)   # keeps the name and doc; __wrapped__ is the original
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if _takes(q, k, cos, sin, unsqueeze_dim):
            return _kernel_for(q.dtype, q.device)(q, k, cos, sin)
        return eager(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.elastic_native = True
    return apply_rotary_pos_emb


def use_native_rotary(modeling_module: str, function_name: str, device: torch.device | None = None) -> bool:
    """Wrap `function_name` of `modeling_module` (HF's Llama rotary formula) with the kernel of `device` (default:
    the CPU), once. True when the wrapped version is in place and has a kernel for that device."""
    if _kernel_for(torch.float32, torch.device(device or "cpu")) is None:
        return False
    module = importlib.import_module(modeling_module)
    current = getattr(module, function_name)
    if not getattr(current, "elastic_native", False):
        setattr(module, function_name, _native_version(current))
    return True
