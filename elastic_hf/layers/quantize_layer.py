"""Quantized copies of whole decoder layers: build (RTN or AWQ), run, save and load as safetensors.

A quantized layer is a deep copy of the HF decoder layer whose nn.Linear modules are QuantLinear modules, so it
has the same forward signature and the HF modeling code runs it unchanged (a drop-in replacement). With AWQ the
copy's own norm weights carry the folded scales, so the variant is self-contained: swapping it in for the
full-precision layer needs nothing else changed.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from elastic_hf.layers.awq import AwqConfig, fold_awq_scales, search_awq_scales
from elastic_hf.layers.quant_linear import empty_quant_linear, is_quant_linear, quantize_linear, reference_linear
from elastic_hf.layers.quant_scheme import QuantScheme, fake_quantize

VARIANT_FORMAT = "elastic-hf-layer-variant/1"


def decoder_layer_kwargs(model: nn.Module, batch: int, seq_len: int, device=None) -> dict:
    """Keyword arguments to call one HF decoder layer directly on [batch, seq_len, hidden] (positions 0..T-1,
    causal). With SDPA, attention_mask=None makes HF use is_causal; other implementations get an explicit
    additive causal mask."""
    device = device or next(model.parameters()).device
    position_ids = torch.arange(seq_len, device=device)[None, :]  # [1, seq]
    dummy = torch.zeros(1, seq_len, 1, device=device, dtype=torch.float32)
    position_embeddings = model.model.rotary_emb(dummy, position_ids)
    mask = None
    if getattr(model.config, "_attn_implementation", "sdpa") != "sdpa":
        mask = torch.full((seq_len, seq_len), float("-inf"), device=device).triu(1)[None, None]  # [1, 1, seq, seq]
        mask = mask.expand(batch, 1, seq_len, seq_len)
    return {"attention_mask": mask, "position_ids": position_ids, "position_embeddings": position_embeddings}


def _replace(layer: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(layer.get_submodule(parent_name) if parent_name else layer, child, module)


def quantize_decoder_layer(layer: nn.Module, adapter, scheme: QuantScheme, hf_config=None,
                           awq_scales=None) -> nn.Module:
    """A quantized deep copy of `layer` (the original is untouched). Pass `awq_scales` (with hf_config) for AWQ."""
    return _quantize(layer, adapter, scheme, hf_config, awq_scales, with_reference=False)[0]


def _quantize(layer, adapter, scheme, hf_config, awq_scales, with_reference: bool):
    for name in adapter.linear_names():
        scheme.check_in_features(layer.get_submodule(name).in_features, name)
    quantized = copy.deepcopy(layer)
    if awq_scales is not None:
        fold_awq_scales(quantized, adapter, hf_config, awq_scales)
    # The reference copy gets fake_quantize(W): the very numbers the QuantLinear stores (same q, scales, zeros),
    # computed here without unpacking the kernel layout again.
    reference = copy.deepcopy(quantized) if with_reference else None
    for name in adapter.linear_names():
        linear = quantized.get_submodule(name)
        _replace(quantized, name, quantize_linear(linear, scheme, name))
        if reference is not None:
            reference_linear_ = reference.get_submodule(name)
            reference_linear_.weight.data.copy_(fake_quantize(reference_linear_.weight.data, scheme))
    quantized.quant_scheme = scheme
    if reference is not None:
        reference.quant_scheme = scheme
        reference = reference.eval().requires_grad_(False)
    return quantized.eval().requires_grad_(False), reference


@dataclass(slots=True)
class CalibratedLayer:
    quantized: nn.Module                 # QuantLinear (int kernel) variant: what gets served
    reference: nn.Module | None          # fp32 copy with the dequantized weights (offline tools), if asked for
    fp_output: torch.Tensor | None       # the full-precision layer's output on the calibration input, if run


def calibrate_and_quantize(layer: nn.Module, adapter, hf_config, scheme: QuantScheme,
                           hidden_states: torch.Tensor | None = None, layer_kwargs: dict | None = None,
                           awq_config: AwqConfig | None = None, with_reference: bool = False) -> CalibratedLayer:
    """RTN needs no data; AWQ searches its scales on hidden_states [batch, seq, hidden] (the layer's
    full-precision input on calibration text) and reports the full-precision output it computed on the way."""
    if scheme.method == "rtn":
        quantized, reference = _quantize(layer, adapter, scheme, hf_config, None, with_reference)
        return CalibratedLayer(quantized, reference, None)
    if hidden_states is None or layer_kwargs is None:
        raise ValueError("method='awq' needs calibration hidden_states and layer_kwargs; use method='rtn' without data")
    scales, output = search_awq_scales(layer, adapter, hf_config, hidden_states, layer_kwargs, scheme, awq_config)
    quantized, reference = _quantize(layer, adapter, scheme, hf_config, scales, with_reference)
    quantized.awq_scales = scales
    return CalibratedLayer(quantized, reference, output)


def reference_layer(quantized: nn.Module) -> nn.Module:
    """A copy of a quantized layer whose QuantLinears are fp32 nn.Linear holding the dequantized weights: the
    same function (to ~1e-6), at fp32 GEMM speed, for offline profiling and perplexity sweeps."""
    reference = copy.deepcopy(quantized)
    for name, module in list(reference.named_modules()):
        if is_quant_linear(module):
            _replace(reference, name, reference_linear(module))
    return reference


def save_layer_variant(path: str | Path, quantized: nn.Module, layer_index: int, model_id: str = "") -> None:
    scheme: QuantScheme = quantized.quant_scheme
    state = {k: v.detach().contiguous().cpu() for k, v in quantized.state_dict().items()}
    metadata = {"format": VARIANT_FORMAT, "scheme": scheme.to_json(), "layer_index": str(layer_index),
                "model_id": model_id}
    save_file(state, str(path), metadata=metadata)


def read_variant_metadata(path: str | Path) -> dict:
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if metadata.get("format") != VARIANT_FORMAT:
        raise ValueError(f"{path} is not an elastic-hf layer variant (format={metadata.get('format')!r}, "
                         f"expected {VARIANT_FORMAT!r})")
    return metadata


def load_layer_variant(path: str | Path, full_precision_layer: nn.Module, adapter,
                       device: torch.device | str | None = None) -> nn.Module:
    """Rebuild a saved variant on the structure of the matching full-precision layer."""
    metadata = read_variant_metadata(path)
    scheme = QuantScheme.from_dict(json.loads(metadata["scheme"]))
    device = torch.device(device) if device is not None else next(full_precision_layer.parameters()).device
    quantized = copy.deepcopy(full_precision_layer).to(device)
    for name in adapter.linear_names():
        linear = quantized.get_submodule(name)
        _replace(quantized, name, empty_quant_linear(linear.in_features, linear.out_features,
                                                     linear.bias is not None, scheme, device, name))
    with safe_open(str(path), framework="pt", device=str(device)) as handle:
        state = {key: handle.get_tensor(key) for key in handle.keys()}
    quantized.load_state_dict(state, strict=True)
    quantized.quant_scheme = scheme
    quantized.layer_index = int(metadata["layer_index"])
    return quantized.eval().requires_grad_(False)
