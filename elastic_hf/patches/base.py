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
    has_qkv_bias: bool = False

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers_path)

    def linear_names(self) -> tuple[str, ...]:
        """Every nn.Linear of a decoder layer, relative to the layer."""
        return (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj, self.down_proj)

    def fusion_groups(self, layers: nn.ModuleList) -> list[list[nn.Module]]:
        """Per decoder layer, the linears HF calls back to back on one input: (q, k, v) and (gate, up)."""
        return [[layer.get_submodule(name) for name in names] for layer in layers
                for names in ((self.q_proj, self.k_proj, self.v_proj), (self.gate_proj, self.up_proj))]

    def head_counts(self, config) -> tuple[int, int, int]:
        """(num_attention_heads, num_key_value_heads, head_dim)."""
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return num_heads, num_kv_heads, head_dim
