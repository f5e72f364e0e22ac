"""A switched Llama-family layer's plan for the lean decode step (layers/lean_decode.py): its LeanLayer (the
weights, biases, sizes and eps native/lean_layer.c reads), built once and kept while the layer's parts stay the
ones it was built from, so that a decode step checks a key (~2 us a layer) instead of ~60 us of checks and
conversions. A layer whose parts are not all of the kinds the C layer runs gets a plan without a structure (kept
too: the check is not repeated every step while the layer stays so)."""
from __future__ import annotations

import ctypes
import weakref

import torch
from torch import nn

from elastic_hf.layers.native_norm import NativeRMSNorm
from elastic_hf.layers.packed_linear import FusedMemberLinear, PackedLinear
from elastic_hf.layers.swiglu_mlp import SwiGLUMLP
from elastic_hf.native.lean_layer import LeanLayer, lean_layer_entries


class LayerPlan:
    """A layer's LeanLayer, valid while `key` (the identities of its parts and the addresses read) is the layer's."""

    __slots__ = ("key", "struct", "address", "native_silu", "max_tokens", "head_dim", "inter", "widths", "act_fn",
                 "keep")


# layer -> its plan (weakly: a retired instance's layers go with it; a plan holds raw addresses, so it is never
# copied with a layer). Through its key a plan holds the modules and packed products it read until the layer's next
# decode step finds them changed: what a layer drops between two steps lives one step longer (the memory reshapes,
# drops and morphs give back is arena pages, which no reference keeps).
_plans: weakref.WeakKeyDictionary[nn.Module, LayerPlan] = weakref.WeakKeyDictionary()


def _plan_key(layer, dtype: torch.dtype) -> tuple:
    """What the plan was built from: the modules, the packed products they read (a repack makes a new one) and the
    norms' addresses. Read from the modules' own dicts: nn.Module's attribute fallback costs ~0.6 us a name, 13 us a
    layer here, against ~4 us so (the ~60 us of checks and conversions the plan saves are the point)."""
    modules = layer._modules
    attn, mlp = modules["self_attn"]._modules, modules["mlp"]
    mlp_modules = mlp._modules
    parts = (attn.get("q_proj"), attn.get("k_proj"), attn.get("v_proj"), attn.get("o_proj"),
             mlp_modules.get("gate_proj"), mlp_modules.get("up_proj"), mlp_modules.get("down_proj"))
    norm1, norm2 = modules["input_layernorm"], modules["post_attention_layernorm"]
    return (dtype, mlp, norm1, norm2, norm1._parameters["weight"].data_ptr(), norm2._parameters["weight"].data_ptr(),
            *parts, *map(_direct_of, parts))


def _direct_of(module):
    """The DirectProduct a linear reads (a fused member: its group's), or None."""
    if module is None:
        return None
    fused = module.__dict__.get("fused")
    return module.__dict__.get("direct") if fused is None else getattr(fused, "direct", None)


def layer_plan(layer, dtype: torch.dtype) -> LayerPlan:
    """The layer's plan for activations of `dtype`: the one kept, or a new one where its key changed."""
    key = _plan_key(layer, dtype)
    plan = _plans.get(layer)
    if plan is None or plan.key != key:
        plan = _plans[layer] = _build_plan(layer, dtype, key)
    return plan


def _packed(module, dtype: torch.dtype):
    """The DirectProduct of a packed linear the native kernel reads in `dtype`, else None."""
    direct = getattr(module, "direct", None)
    return direct if direct is not None and direct.dtype == dtype else None


# HF MLP classes whose forward is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)): a morphing instance keeps them
HF_SWIGLU_MLP_CLASSES = ("LlamaMLP", "Qwen2MLP", "MistralMLP")


def _projections(attn, dtype: torch.dtype) -> list | None:
    """q/k/v as [(DirectProduct, bias, first output column)]: one fused product, or three packed linears (a morphing
    instance packs each alone) written side by side into one [T, q | k | v] buffer; None where one is neither."""
    q_proj, k_proj, v_proj = attn.q_proj, attn.k_proj, attn.v_proj
    if type(q_proj) is FusedMemberLinear:
        qkv = q_proj.fused
        if qkv.num_members != 3 or k_proj.fused is not qkv or v_proj.fused is not qkv or not qkv.packed:
            return None
        parts = [(_packed(qkv, dtype), qkv.bias, 0)]
    elif type(q_proj) is PackedLinear and type(k_proj) is PackedLinear and type(v_proj) is PackedLinear:
        q_size, kv_size = q_proj.out_features, k_proj.out_features
        parts = [(_packed(m, dtype), m.bias, start)
                 for m, start in ((q_proj, 0), (k_proj, q_size), (v_proj, q_size + kv_size))]
    else:
        return None
    return parts if all(direct is not None for direct, _, _ in parts) else None


def _mlp_products(mlp, dtype: torch.dtype) -> tuple[list, bool] | None:
    """gate/up as [(DirectProduct, bias, first output column)] into one [T, gate | up] buffer, and whether silu * up
    runs in the native kernel (SwiGLUMLP) or as HF's act_fn and product (HF's MLP on packed linears)."""
    if type(mlp) is SwiGLUMLP:
        gate_up = mlp.gate_proj.fused
        if gate_up.num_members != 2 or mlp.up_proj.fused is not gate_up or not gate_up.packed:
            return None
        parts, native = [(_packed(gate_up, dtype), gate_up.bias, 0)], True
    elif (type(mlp).__name__ in HF_SWIGLU_MLP_CLASSES and type(mlp).__module__.startswith("transformers.models.")
          and type(mlp.gate_proj) is PackedLinear and type(mlp.up_proj) is PackedLinear):
        parts = [(_packed(mlp.gate_proj, dtype), mlp.gate_proj.bias, 0),
                 (_packed(mlp.up_proj, dtype), mlp.up_proj.bias, mlp.gate_proj.out_features)]
        native = False
    else:
        return None
    return (parts, native) if all(direct is not None for direct, _, _ in parts) else None


def _build_plan(layer, dtype: torch.dtype, key: tuple) -> LayerPlan:
    """The layer's plan; its `struct` is None where a part is not of the kinds above (kept, so that the check is not
    repeated every step while the layer stays so)."""
    plan = LayerPlan()
    plan.key, plan.struct = key, None
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    o_proj, down_proj = attn.o_proj, getattr(mlp, "down_proj", None)
    if (type(norm1) is not NativeRMSNorm or type(norm2) is not NativeRMSNorm or norm1.weight.dtype != dtype
            or norm2.weight.dtype != dtype or type(o_proj) is not PackedLinear or type(down_proj) is not PackedLinear
            or lean_layer_entries() is None):
        return plan
    qkv_parts, mlp_parts = _projections(attn, dtype), _mlp_products(mlp, dtype)
    o_w, down_w = _packed(o_proj, dtype), _packed(down_proj, dtype)
    if qkv_parts is None or mlp_parts is None or o_w is None or down_w is None:
        return plan
    gate_up_parts, native_silu = mlp_parts
    head_dim, hidden = attn.head_dim, o_w.out_features
    q_size, kv_size = attn.q_proj.out_features, attn.k_proj.out_features
    inter2 = sum(direct.out_features for direct, _, _ in gate_up_parts)
    inter = inter2 // 2
    if (q_size != o_proj.in_features or down_proj.in_features != inter or down_w.out_features != hidden
            or sum(d.out_features for d, _, _ in qkv_parts) != q_size + 2 * kv_size
            or q_size % head_dim or kv_size % head_dim or norm1.weight.numel() != hidden):
        return plan
    s = LeanLayer()
    s.norm1, s.norm2 = norm1.weight.data_ptr(), norm2.weight.data_ptr()
    s.eps1, s.eps2, s.scaling = norm1.variance_epsilon, norm2.variance_epsilon, attn.scaling
    s.hidden, s.q_size, s.kv_size, s.head_dim, s.inter = hidden, q_size, kv_size, head_dim, inter
    s.n_qkv, s.n_gate_up = len(qkv_parts), len(gate_up_parts)
    products = [*qkv_parts, (o_w, o_proj.bias, 0), *gate_up_parts, (down_w, down_proj.bias, 0)]
    slots = [*s.qkv[:len(qkv_parts)], s.o, *s.gate_up[:len(gate_up_parts)], s.down]
    for slot, (direct, bias, column) in zip(slots, products):
        slot.weight, slot.bias, slot.n, slot.column = direct.weight_ptr, _ptr(bias), direct.out_features, column
    plan.struct, plan.address = s, ctypes.addressof(s)
    plan.native_silu = native_silu
    plan.max_tokens = min(direct.onednn_from_rows for direct, _, _ in products)   # oneDNN runs from there on
    plan.head_dim, plan.inter = head_dim, inter
    plan.widths = (hidden, q_size + 2 * kv_size, q_size, kv_size, q_size, hidden, inter2, inter, hidden)  # WORKSPACE
    plan.act_fn = None if native_silu else mlp.act_fn
    # what the addresses point into: the plan keeps them alive while it lives (the key holds the modules)
    plan.keep = (norm1.weight, norm2.weight, *(bias for _, bias, _ in products))
    return plan


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
