"""AWQ: activation-aware per-input-channel scales for weight-only quantization (Lin et al., 2024).

Weights that meet large activations matter more. For a group of linears reading the same input x, AWQ scales
input channel c of their weights by s_c and divides x_c by s_c, which leaves the full-precision function
unchanged but gives salient channels more of the quantization grid:  x @ W^T == (x / s) @ (W * s)^T.
s = mean|x|^alpha (normalised so that max(s) * min(s) == 1) and alpha is chosen from a grid in [0, 1) to
minimise the output MSE of the quantized linears on calibration activations. alpha = 0 is s = 1, i.e. plain
round-to-nearest, so on the calibration tokens the search never does worse than RTN.

The 1 / s is folded into whatever produces x, so inference runs no extra op:
  input_layernorm weight          -> q_proj, k_proj, v_proj input
  v_proj output rows (and bias)   -> o_proj input   (with GQA one scale per KV channel, repeated over the
                                                     query heads that read it, so the fold stays exact)
  post_attention_layernorm weight -> gate_proj, up_proj input
  up_proj output rows             -> down_proj input (the MLP is down(act(gate(x)) * up(x)), linear in up)
Row scaling of v_proj / up_proj does not change their own quantization: both W8 (per output channel) and W4
(groups along the input dimension) are invariant to scaling a whole output row.
Not implemented: AutoAWQ's weight clipping search, and searching q/k/v against the attention output.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from elastic_hf.layers.quant_scheme import QuantScheme, fake_quantize

_MIN_ACT = 1e-4  # AutoAWQ's floor: channels that never fire must not get a zero (or infinite) scale


@dataclass(slots=True)
class AwqConfig:
    num_grid: int = 20          # alpha in {0, 1/num_grid, ..., (num_grid-1)/num_grid}
    max_loss_tokens: int = 512  # tokens (sampled with `seed`) on which the output MSE is evaluated
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.num_grid <= 1000:
            raise ValueError(f"num_grid={self.num_grid} must be in [1, 1000]")
        if self.max_loss_tokens < 1:
            raise ValueError(f"max_loss_tokens={self.max_loss_tokens} must be >= 1")


@dataclass(slots=True)
class AwqScales:
    """Per-input-channel scales of one decoder layer; each tensor is folded as described in the module doc."""
    qkv: torch.Tensor                 # [hidden]
    vo: torch.Tensor                  # [num_kv_heads * head_dim]
    gate_up: torch.Tensor             # [hidden]
    down: torch.Tensor                # [intermediate]
    alphas: dict[str, float] = field(default_factory=dict)
    rtn_loss: dict[str, float] = field(default_factory=dict)
    awq_loss: dict[str, float] = field(default_factory=dict)


def capture_linear_inputs(layer: nn.Module, adapter, hidden_states: torch.Tensor, layer_kwargs: dict
                          ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Run the full-precision layer once; returns the input of each linear group, flattened to
    [num_tokens, in_features], and the layer output [batch, seq, hidden] (callers reuse it instead of running
    the layer again)."""
    names = {"qkv": adapter.q_proj, "o": adapter.o_proj, "gate_up": adapter.gate_proj, "down": adapter.down_proj}
    captured: dict[str, torch.Tensor] = {}
    handles = []
    for key, name in names.items():
        def hook(module, args, key=key):
            captured[key] = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        handles.append(layer.get_submodule(name).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            output = layer(hidden_states, **layer_kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return captured, output


def _search(x: torch.Tensor, weights: list[torch.Tensor], scheme: QuantScheme, config: AwqConfig,
            channel_mean: torch.Tensor, expand) -> tuple[torch.Tensor, float, float, float]:
    """Grid search of alpha. x [num_tokens, in]; channel_mean [num_scales]; expand maps [num_scales] -> [in].
    Returns (scales [num_scales], alpha, rtn_loss, best_loss)."""
    generator = torch.Generator().manual_seed(config.seed)
    if x.shape[0] > config.max_loss_tokens:
        rows = torch.randperm(x.shape[0], generator=generator)[: config.max_loss_tokens].sort().values
        x = x[rows.to(x.device)]  # [loss_tokens, in]
    references = [x @ w.T for w in weights]  # each [loss_tokens, out]
    num_outputs = sum(r.numel() for r in references)
    channel_mean = channel_mean.clamp(min=_MIN_ACT)
    best = (float("inf"), None, 0.0)
    rtn_loss = float("nan")
    for step in range(config.num_grid):
        alpha = step / config.num_grid
        scales = channel_mean.pow(alpha)
        scales = scales / (scales.max() * scales.min()).sqrt()  # [num_scales]
        full = expand(scales)  # [in]
        error = 0.0
        for w, ref in zip(weights, references):
            effective = fake_quantize(w * full[None, :], scheme) / full[None, :]  # [out, in]
            error += (x @ effective.T - ref).pow(2).sum().item()
        loss = error / num_outputs
        if step == 0:
            rtn_loss = loss
        if loss < best[0]:
            best = (loss, scales, alpha)
    return best[1], best[2], rtn_loss, best[0]


def search_awq_scales(layer: nn.Module, adapter, hf_config, hidden_states: torch.Tensor, layer_kwargs: dict,
                      scheme: QuantScheme, config: AwqConfig | None = None) -> tuple[AwqScales, torch.Tensor]:
    """hidden_states [batch, seq, hidden]: the layer's full-precision input on calibration text. Returns the
    scales and the full-precision layer output on hidden_states."""
    if adapter.awq_refusal:
        raise ValueError(f"AWQ cannot calibrate {adapter.model_types[0]} layers: {adapter.awq_refusal}")
    config = config or AwqConfig()
    num_heads, num_kv_heads, head_dim = adapter.head_counts(hf_config)
    group = num_heads // num_kv_heads
    inputs, output = capture_linear_inputs(layer, adapter, hidden_states, layer_kwargs)
    weight = lambda name: layer.get_submodule(name).weight.detach().float()  # noqa: E731
    identity = lambda s: s  # noqa: E731
    found: dict[str, torch.Tensor] = {}
    alphas, rtn_losses, awq_losses = {}, {}, {}

    def run(key, x, names, channel_mean, expand):
        scales, alpha, rtn_loss, best_loss = _search(x, [weight(n) for n in names], scheme, config,
                                                     channel_mean, expand)
        found[key], alphas[key], rtn_losses[key], awq_losses[key] = scales, alpha, rtn_loss, best_loss

    x = inputs["qkv"]
    run("qkv", x, [adapter.q_proj, adapter.k_proj, adapter.v_proj], x.abs().mean(0), identity)

    # o_proj input channel (head h, dim d) reads V of kv head h // group: one scale per KV channel.
    x = inputs["o"]  # [num_tokens, num_heads * head_dim]
    kv_mean = x.abs().reshape(-1, num_kv_heads, group, head_dim).mean(dim=(0, 2)).reshape(-1)  # [kv_dim]
    expand_kv = lambda s: s.reshape(num_kv_heads, 1, head_dim).expand(num_kv_heads, group, head_dim).reshape(-1)  # noqa: E731
    run("vo", x, [adapter.o_proj], kv_mean, expand_kv)

    x = inputs["gate_up"]
    run("gate_up", x, [adapter.gate_proj, adapter.up_proj], x.abs().mean(0), identity)

    x = inputs["down"]
    run("down", x, [adapter.down_proj], x.abs().mean(0), identity)
    scales = AwqScales(qkv=found["qkv"], vo=found["vo"], gate_up=found["gate_up"], down=found["down"],
                       alphas=alphas, rtn_loss=rtn_losses, awq_loss=awq_losses)
    return scales, output


@torch.no_grad()
def fold_awq_scales(layer: nn.Module, adapter, hf_config, scales: AwqScales) -> None:
    """Apply the scales to a (copied) full-precision layer in place; its function is unchanged up to fp32
    rounding. Quantize the linears afterwards."""
    if adapter.awq_refusal:
        raise ValueError(f"AWQ scales cannot fold into {adapter.model_types[0]} layers: {adapter.awq_refusal}")
    num_heads, num_kv_heads, head_dim = adapter.head_counts(hf_config)
    group = num_heads // num_kv_heads

    def scale_inputs(name, s):
        linear = layer.get_submodule(name)
        linear.weight.mul_(s.to(linear.weight.dtype)[None, :])

    def scale_outputs_down(name, s):
        linear = layer.get_submodule(name)
        linear.weight.div_(s.to(linear.weight.dtype)[:, None])
        if linear.bias is not None:
            linear.bias.div_(s.to(linear.bias.dtype))

    def scale_norm_down(name, s):
        norm = layer.get_submodule(name)
        norm.weight.div_(s.to(norm.weight.dtype))

    scale_norm_down(adapter.input_norm, scales.qkv)
    for name in (adapter.q_proj, adapter.k_proj, adapter.v_proj):
        scale_inputs(name, scales.qkv)
    scale_outputs_down(adapter.v_proj, scales.vo)
    expanded = scales.vo.reshape(num_kv_heads, 1, head_dim).expand(num_kv_heads, group, head_dim).reshape(-1)
    scale_inputs(adapter.o_proj, expanded)
    scale_norm_down(adapter.mlp_norm, scales.gate_up)
    for name in (adapter.gate_proj, adapter.up_proj):
        scale_inputs(name, scales.gate_up)
    scale_outputs_down(adapter.up_proj, scales.down)
    scale_inputs(adapter.down_proj, scales.down)
