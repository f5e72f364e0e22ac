"""What elastic-hf needs to know about one HF decoder architecture: where the decoder layers are and what the
attention / MLP / norm modules are called. The HF modeling code itself runs unchanged."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True, slots=True)
class ArchAdapter:
    model_types: tuple[str, ...]
    layers_path: str = "model.layers"
    q_proj: str = "self_attn.q_proj"
    k_proj: str = "self_attn.k_proj"
    v_proj: str = "self_attn.v_proj"
    o_proj: str = "self_attn.o_proj"
    gate_proj: str = "mlp.gate_proj"
    up_proj: str = "mlp.up_proj"
    down_proj: str = "mlp.down_proj"
    input_norm: str = "input_layernorm"
    post_attention_norm: str = "post_attention_layernorm"
    final_norm: str = "model.norm"
    embed_tokens: str = "model.embed_tokens"
    lm_head: str = "lm_head"
    mlp: str = "mlp"
    has_qkv_bias: bool = False
    # HF's class of the norms, when its forward is LlamaRMSNorm's formula (layers/native_norm.py runs it natively)
    rms_norm_class: str = "LlamaRMSNorm"
    # the function of HF's modeling module that applies Llama's rotary formula to q and k (layers/native_rotary.py
    # runs it natively), or None where the architecture's rotary differs
    rotary_function: str | None = "apply_rotary_pos_emb"

    @property
    def modeling_module(self) -> str:
        """HF's modeling module of the architecture, e.g. transformers.models.llama.modeling_llama."""
        name = self.model_types[0]
        return f"transformers.models.{name}.modeling_{name}"

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers_path)

    def linear_names(self) -> tuple[str, ...]:
        """Every nn.Linear of a decoder layer, relative to the layer."""
        return (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj, self.down_proj)

    def fusion_groups(self, layers: nn.ModuleList) -> list[list[nn.Module]]:
        """Per decoder layer, the linears HF calls back to back on one input: (q, k, v) and (gate, up)."""
        return [[layer.get_submodule(name) for name in names] for layer in layers
                for names in ((self.q_proj, self.k_proj, self.v_proj), (self.gate_proj, self.up_proj))]

    def norms(self, model: nn.Module, layers: nn.ModuleList) -> list[nn.Module]:
        """Every RMSNorm the forward runs: each layer's two and the final one (a pipeline stage's model may lack
        the final one)."""
        norms = [layer.get_submodule(name) for layer in layers for name in (self.input_norm, self.post_attention_norm)]
        try:
            norms.append(model.get_submodule(self.final_norm))
        except AttributeError:
            pass
        return norms

    def mlps(self, layers: nn.ModuleList) -> list[nn.Module]:
        return [layer.get_submodule(self.mlp) for layer in layers]

    def head_counts(self, config) -> tuple[int, int, int]:
        """(num_attention_heads, num_key_value_heads, head_dim)."""
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return num_heads, num_kv_heads, head_dim
