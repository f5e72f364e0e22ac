"""The forward of a Llama-formula causal LM whose decoder layers are all switched (layers/fused_decoder_layer.py),
as one flat function of ours over HF's own modules: embed -> rotary embedding -> the layers -> final norm -> the LM
head on the rows that sample.

Why: HF's two model forwards wrap that sequence in `deprecate_kwarg`, `merge_with_config_defaults`,
`capture_outputs` and `auto_docstring` layers, build a causal mask the switched layers never read (the paged batch
says what attends to what), slice `layers[:num_hidden_layers]` into a new ModuleList, call every layer through
nn.Module's `__call__` and wrap the outputs in dataclasses: ~1.3 ms of a ~10.5 ms batch-1 bf16 step of the default
model on a 2-core Zen 5 EPYC by section timers (with lean runs, in-process A/Bs: 1.02-1.07x a decode step). Here the
same modules run in the same order on the same tensors, so the logits are HF's bit for bit
(tests/model/test_flat_forward.py); the layers a lean run computed already (layers/lean_decode.py) are not called at
all. A pipeline stage runs the same way: its foreign layers (model/stage.py's SkippedLayer) are skipped,
its norm is the identity unless it is the last stage, and a stage that is not the last returns hidden states.

Only HF's own classes of the families whose forwards are exactly that sequence take it; anything else (another
family, a layer not switched: `fused_layers off`, CUDA's default, a forward hook on the model) runs HF's forward."""
from __future__ import annotations

import torch
from torch import nn

from elastic_hf.layers.fused_decoder_layer import FusedDecoderLayer
from elastic_hf.layers.lean_decode import take_lean_run
from elastic_hf.model.stage import SkippedLayer

# HF causal-LM classes whose forward is lm_head(model(...).last_hidden_state[:, keep]) and their decoders', whose
# forward is norm(layers(rotary(embed(ids)))) (Qwen2's per-layer masks: ignored by switched layers)
FLAT_MODEL_CLASSES = {"LlamaForCausalLM": "LlamaModel", "Qwen2ForCausalLM": "Qwen2Model",
                      "MistralForCausalLM": "MistralModel"}


class FlatForward:
    """The flat forward of one HF model (`for_model` says whether it can take one)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.decoder = model.model
        self.lm_head = model.lm_head
        self.num_layers = model.model.config.num_hidden_layers

    @classmethod
    def for_model(cls, model: nn.Module) -> FlatForward | None:
        decoder = getattr(model, "model", None)
        if (FLAT_MODEL_CLASSES.get(type(model).__name__) != type(decoder).__name__
                or not all(type(m).__module__.startswith("transformers.models.") for m in (model, decoder))
                or getattr(model.config, "final_logit_softcapping", None) is not None
                or not all(hasattr(decoder, name) for name in ("embed_tokens", "rotary_emb", "layers", "norm"))):
            return None
        return cls(model)

    def runs_now(self) -> bool:
        """Every layer HF would call is switched (or a stage's pass-through) and no hook watches the model's
        forwards: checked every step, since morphing swaps layers and stages swap them out."""
        decoder = self.decoder
        layers = decoder.layers
        if len(layers) != self.num_layers or self.model._forward_hooks or self.model._forward_pre_hooks \
                or decoder._forward_hooks or decoder._forward_pre_hooks:
            return False
        return all(type(layer) is FusedDecoderLayer or type(layer) is SkippedLayer
                   for layer in layers._modules.values())

    def __call__(self, positions: torch.Tensor, batch, input_ids: torch.Tensor | None = None,
                 hidden_in: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """positions: [1, T]; input_ids [1, T] (a first stage) or hidden_in [1, T, hidden] (a later one); keep: the
        packed rows whose logits the step needs (None: a stage that is not the last, which returns the final
        hidden states [1, T, hidden]). Returns logits [1, len(keep), vocab] in the model's dtype."""
        decoder = self.decoder
        hidden = decoder.embed_tokens(input_ids) if hidden_in is None else hidden_in      # [1, T, hidden]
        position_embeddings = decoder.rotary_emb(hidden, position_ids=positions)           # cos, sin: [1, T, hd]
        layers = list(decoder.layers._modules.values())
        i = 0
        while i < len(layers):
            layer = layers[i]
            i += 1
            if type(layer) is SkippedLayer:   # held by another pipeline stage
                continue
            hidden = layer(hidden, position_embeddings=position_embeddings, paged_batch=batch)
            i += take_lean_run(batch, hidden)   # the layers after it that a lean run computed with it
        hidden = decoder.norm(hidden)          # (a stage that is not the last: nn.Identity)
        if keep is None:
            return hidden
        return self.lm_head(hidden[:, keep, :])
