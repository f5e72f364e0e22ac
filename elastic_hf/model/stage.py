"""A pipeline stage's view of an HF model: the decoder layers it does not hold become pass-throughs and, unless it is
the last stage, the final norm is the identity. HF's own modeling code still runs the forward: the first stage from
token ids, later stages from received hidden states via `inputs_embeds`; only the last stage runs the LM head.

Foreign layers are replaced in the decoder's ModuleList (not removed) so every model layer keeps its index: the
attention's `layer_idx` picks the KV layer, and loops such as Qwen2's read `config.layer_types[i]` by position."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


class SkippedLayer(nn.Module):
    """Stands in for a decoder layer another stage holds: returns the hidden states unchanged."""

    def __init__(self, layer_idx: int, attention_type: str | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_type = attention_type   # read by some HF decoder loops

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx} (held by another pipeline stage)"


@dataclass(frozen=True, slots=True)
class StageSpec:
    layer_start: int
    layer_end: int
    is_first: bool = True
    is_last: bool = True

    @property
    def layers(self) -> tuple[int, int]:
        return self.layer_start, self.layer_end


class StageView:
    """Switches one HF model between stage layouts in place (cheap: module references only)."""

    def __init__(self, hf_model: nn.Module, layers: nn.ModuleList, input_scale: str | None = None):
        """input_scale: an attribute of the decoder that scales `inputs_embeds` in its forward (Granite's
        embedding_multiplier, ArchAdapter.stage_input_scale): 1 on a later stage, whose inputs are hidden states."""
        self.decoder = hf_model.get_decoder()
        self.layers = layers                     # the decoder's ModuleList, shared with the weights and morphing
        self.held: list[nn.Module] = list(layers)
        self.norm = self.decoder.norm
        self.input_scale = input_scale
        self.scale = getattr(self.decoder, input_scale) if input_scale else None
        self.spec = StageSpec(0, len(layers))

    def apply(self, spec: StageSpec) -> None:
        if not 0 <= spec.layer_start < spec.layer_end <= len(self.layers):
            raise ValueError(f"a stage holds layers [start, end) within [0, {len(self.layers)}], got "
                             f"[{spec.layer_start}, {spec.layer_end})")
        for i, module in enumerate(self.layers):
            if not isinstance(module, SkippedLayer):
                self.held[i] = module   # the module serving now (precision morphing may have swapped it)
        for i, module in enumerate(self.held):
            inside = spec.layer_start <= i < spec.layer_end
            self.layers[i] = module if inside else SkippedLayer(i, getattr(module, "attention_type", None))
        self.decoder.norm = self.norm if spec.is_last else nn.Identity()
        if self.input_scale:
            setattr(self.decoder, self.input_scale, self.scale if spec.is_first else 1.0)
        self.spec = spec
