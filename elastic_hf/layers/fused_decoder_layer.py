"""A Llama-family decoder layer whose forward is one flat function of ours, switched in place of HF's.

HF's layer forward is lean, but every layer of every step still goes through two `deprecate_kwarg` wrappers (each
inspects the call's keyword arguments), the gradient-checkpointing `__call__`, nine module calls (attention, q, k,
v, o, two norms, the MLP and its own), the attention-interface lookup and its wrapper, and view / transpose /
contiguous calls, ~100 µs of Python a layer on the 2-core test machine: at batch 1 a third of a default-model step.
The switched layer keeps HF's modules and parameters (morphing swaps the linears, sharding shards them, dropping
drops whole layers: the layer calls whatever modules sit there now) and computes HF's formula in HF's order:

    h = input_norm(x); q, k, v = the q/k/v projections of h (one GEMM when they are one fused product); rotary;
    paged attention (the step's backend, kv/attention_backends.py); x = x + o_proj(attn); x = x + mlp(post_norm(x))

so its outputs are bit-identical to HF's (tests/layers/test_fused_decoder_layer.py). What it does not take (no
engine step: the paged batch is missing; a family with q/k norms or post-norms) goes to HF's forward, as does every
layer when EngineConfig.fused_layers is "off" (`elastic-hf serve --fused-layers off`)."""
from __future__ import annotations

import importlib
import sys

import torch
from torch import nn

from elastic_hf.layers.lean_decode import lean_decode_enabled, lean_decode_forward
from elastic_hf.layers.packed_linear import FusedMemberLinear
from elastic_hf.layers.shardable_linear import ShardableLinear

# HF layer classes whose forward is exactly Llama's (pre-norm, q/k/v -> rotary -> attention -> o, SwiGLU MLP of
# any kind behind `mlp`): the only ones switched.
LLAMA_LAYER_CLASSES = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer")
# attention modules of those families: no q/k norms, no per-layer extras the formula above would skip
LLAMA_ATTENTION_CLASSES = ("LlamaAttention", "Qwen2Attention", "MistralAttention")


class FusedDecoderLayer(nn.Module):
    """A switched HF decoder layer; `eager_class` is the class it was. The rotary function is looked up by name in
    the modeling module at every call, as HF's attention does (native where layers/native_rotary.py wrapped it)."""

    eager_class: type
    modeling_module: str      # the architecture's modeling module (a name: a layer stays deep-copyable)
    rotary_name: str          # its apply_rotary_pos_emb
    # read by HF's forward (GradientCheckpointingLayer's wrapper) when it runs as the fallback: never training here
    gradient_checkpointing = False

    def forward(self, hidden_states: torch.Tensor, *args, position_embeddings=None, paged_batch=None,
                **kwargs) -> torch.Tensor:
        if paged_batch is None or position_embeddings is None or args:   # not an engine step: HF's forward
            if paged_batch is not None:
                kwargs["paged_batch"] = paged_batch
            return self.eager_class.forward(self, hidden_states, *args, position_embeddings=position_embeddings,
                                            **kwargs)
        cos, sin = position_embeddings
        rotary = getattr(sys.modules[self.modeling_module], self.rotary_name)
        if lean_decode_enabled() and getattr(rotary, "elastic_native", False):   # a decode-only step's kernels
            out = lean_decode_forward(self, hidden_states, cos, sin, paged_batch)   # (layers/lean_decode.py)
            if out is not None:
                return out
        attn = self.self_attn
        tokens = hidden_states.shape[1]                        # hidden_states: [1, T, hidden]
        h = self.input_layernorm(hidden_states)
        q, k, v = _qkv(attn, h)                                # [1, T, q_size], [1, T, kv_size] x 2
        head_dim = attn.head_dim
        q = q.view(1, tokens, -1, head_dim).transpose(1, 2)   # [1, heads, T, hd]
        k = k.view(1, tokens, -1, head_dim).transpose(1, 2)   # [1, kv_heads, T, hd]
        v = v.view(1, tokens, -1, head_dim).transpose(1, 2)
        q, k = rotary(q, k, cos, sin)
        out = paged_batch.backend.forward(attn, q, k, v, attn.scaling, paged_batch)   # [1, T, heads, hd]
        hidden_states = hidden_states + attn.o_proj(out.view(1, tokens, -1))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def _qkv(attn: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of the normed input: one GEMM when the three are members of one fused product (packed weights, or
    packed shards whose chunks lie back to back), else each projection module as it is now (quantized, sharded)."""
    q_proj = attn.q_proj
    fused = getattr(q_proj, "fused", None)
    if isinstance(q_proj, (FusedMemberLinear, ShardableLinear)) and fused is not None and fused.num_members == 3 \
            and getattr(attn.k_proj, "fused", None) is fused and getattr(attn.v_proj, "fused", None) is fused:
        qkv = fused.product(h)                                # [1, T, q + k + v] (of this shard)
        q_size, kv_size = _width(q_proj), _width(attn.k_proj)
        return qkv[..., :q_size], qkv[..., q_size:q_size + kv_size], qkv[..., q_size + kv_size:]
    return q_proj(h), attn.k_proj(h), attn.v_proj(h)


def _width(member: nn.Module) -> int:
    """Columns a fused product's member reads: a shard's (heads of this TP rank), else the linear's out_features."""
    return member.shard_width if isinstance(member, ShardableLinear) else member.out_features


def fusable_layer(layer: nn.Module) -> bool:
    """HF's own class of a Llama-formula family (not a remote-code class of the same name), with the modules the
    fused forward calls."""
    attn = getattr(layer, "self_attn", None)
    return (type(layer).__name__ in LLAMA_LAYER_CLASSES and type(attn).__name__ in LLAMA_ATTENTION_CLASSES
            and all(type(m).__module__.startswith("transformers.models.") for m in (layer, attn))
            and all(hasattr(layer, name) for name in ("input_layernorm", "post_attention_layernorm", "mlp"))
            and all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")))


def use_fused_layers(layers: nn.ModuleList, modeling_module: str, rotary_function: str | None) -> int:
    """Switch every layer of a Llama-formula family in place (same module, same children). Returns how many."""
    if rotary_function is None:
        return 0
    importlib.import_module(modeling_module)   # in sys.modules from here on
    switched = 0
    for layer in layers:
        if isinstance(layer, FusedDecoderLayer):
            switched += 1
            continue
        if not fusable_layer(layer) or type(layer).__module__ != modeling_module:
            continue
        layer.eager_class = type(layer)
        layer.modeling_module, layer.rotary_name = modeling_module, rotary_function
        layer.__class__ = FusedDecoderLayer
        switched += 1
    return switched
