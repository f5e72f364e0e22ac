"""Perplexity of a causal LM on text windows with some decoder layers replaced (quantized variants).

The full-precision input of every layer on the evaluation windows is computed once and cached, so an
evaluation with layer set Q runs only layers min(Q)..L-1 (everything before the first replaced layer is
unchanged). Used by `elastic-hf profile --evaluate` (MorphServe Table 8) and by tests.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from elastic_hf.layers.quantize_layer import decoder_layer_kwargs


def eval_windows(token_ids: torch.Tensor, seq_len: int, num_windows: int) -> torch.Tensor:
    """The first `num_windows` consecutive non-overlapping windows of `seq_len` tokens: [num_windows, seq_len]."""
    if seq_len < 2:
        raise ValueError(f"eval seq_len={seq_len} must be >= 2")
    available = token_ids.numel() // seq_len
    if num_windows < 1 or num_windows > available:
        raise ValueError(f"eval windows={num_windows} must be in [1, {available}] for {token_ids.numel()} "
                         f"evaluation tokens at seq_len={seq_len}")
    return token_ids[: num_windows * seq_len].reshape(num_windows, seq_len).clone()


@contextlib.contextmanager
def swapped_layers(model: nn.Module, adapter, replacements: dict[int, nn.Module]):
    """Temporarily put replacement modules into the model's decoder layer list (e.g. for HF generate)."""
    layers = adapter.decoder_layers(model)
    originals = {i: layers[i] for i in replacements}
    try:
        for i, module in replacements.items():
            layers[i] = module
        yield model
    finally:
        for i, module in originals.items():
            layers[i] = module


class PerplexityEvaluator:
    """Perplexity on fixed windows [num_windows, seq_len] with any subset of layers replaced."""

    def __init__(self, model: nn.Module, adapter, windows: torch.Tensor):
        self.model = model
        self.adapter = adapter
        self.windows = windows
        self.layers = adapter.decoder_layers(model)
        self.final_norm = model.get_submodule(adapter.final_norm)
        self.lm_head = model.get_submodule(adapter.lm_head)
        self.kwargs = decoder_layer_kwargs(model, windows.shape[0], windows.shape[1])
        self._inputs: list[torch.Tensor] | None = None
        self.layer_forwards = 0

    @torch.no_grad()
    def _layer_inputs(self) -> list[torch.Tensor]:
        if self._inputs is None:
            hidden = self.model.get_submodule(self.adapter.embed_tokens)(self.windows).float()  # [W, T, hidden]
            inputs = [hidden]
            for layer in self.layers:
                hidden = layer(hidden, **self.kwargs)
                inputs.append(hidden)
            self._inputs = inputs
        return self._inputs

    @torch.no_grad()
    def perplexity(self, replacements: dict[int, nn.Module] | None = None) -> float:
        replacements = replacements or {}
        inputs = self._layer_inputs()
        start = min(replacements) if replacements else len(self.layers)
        hidden = inputs[start]
        for i in range(start, len(self.layers)):
            hidden = replacements.get(i, self.layers[i])(hidden, **self.kwargs)
        self.layer_forwards += len(self.layers) - start
        total_nll = 0.0
        for window in range(self.windows.shape[0]):  # one window at a time: logits are [T, vocab]
            logits = self.lm_head(self.final_norm(hidden[window])).float()  # [seq, vocab]
            total_nll += F.cross_entropy(logits[:-1], self.windows[window, 1:], reduction="sum").item()
        return math.exp(total_nll / (self.windows.shape[0] * (self.windows.shape[1] - 1)))


def order_sweep(evaluator: PerplexityEvaluator, references: dict[int, nn.Module], orders: dict[str, list[int]],
                ks: list[int], on_result=None) -> dict[str, dict[int, float]]:
    """Perplexity with the first k layers of each order replaced, for every k in ks. k = 0 and k = L are the
    same model for every order and are evaluated once."""
    num_layers = len(evaluator.layers)
    shared: dict[int, float] = {}
    results: dict[str, dict[int, float]] = {name: {} for name in orders}
    for k in ks:
        for name, order in orders.items():
            if k in (0, num_layers) and k in shared:
                value = shared[k]
            else:
                value = evaluator.perplexity({i: references[i] for i in order[:k]})
                if k in (0, num_layers):
                    shared[k] = value
            results[name][k] = value
            if on_result is not None:
                on_result(name, k, value)
    return results
