"""LIS layer profiling (MorphServe §4.2, Appendix A, Algorithm 1): the order in which to swap decoder layers to
their quantized variant.

    LTS_p = cos(h_p(x), x_p)                   layer transformation sensitivity  (eq. 2)
    LRS_p = cos(h_p(x), h_p^Q(x))              layer replacement sensitivity     (eq. 3)
    MDS_p = cos(f^(Q)(x), f^(Q u {p})(x))      model degradation sensitivity     (eq. 4)
    LIS_p = a1 * LTS_p + a2 * LRS_p + b * MDS_p                                  (eq. 5)

Cosines are per token over the hidden dimension, averaged over all calibration tokens. f(x) is the final
normed hidden state (the LM head's input): the head is one fixed linear map, and computing 49k-vocabulary
logits for every candidate would cost more than the decoder layers that follow it.

Greedy selection (Algorithm 1): Q starts empty; each step scores every layer not in Q and moves the one with the
highest LIS into Q. Cost control, because a naive implementation runs the whole model per candidate:
- the input of every layer under the current Q is cached, so a candidate p runs only layers p..L-1;
- the winner's trajectory is kept, so committing it costs nothing (only layers after it changed);
- `mds_samples` limits the calibration sequences used for MDS (LTS/LRS and AWQ use all of them);
- `refresh` (lazy greedy): after the first step, which scores every layer, a step re-scores candidates in
  order of their previous LIS and stops once the best fresh score is at least the next stale score, or after
  `refresh` re-scorings. MorphServe's Table 2 shows that a layer's quantization effect is nearly independent of
  which other layers are quantized, so stale scores are good guides. refresh=0 re-scores every candidate
  every step: Algorithm 1 verbatim.
Quantized layers run as fp32 reference copies of their dequantized weights (identical to the int kernels to
~1e-6, see layers/quant_linear.reference_linear), which keeps profiling at fp32 GEMM speed on any CPU.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from elastic_hf.layers.awq import AwqConfig
from elastic_hf.layers.quant_scheme import QuantScheme
from elastic_hf.layers.quantize_layer import calibrate_and_quantize, decoder_layer_kwargs, reference_layer

PROFILE_FORMAT = "elastic-hf-lis-profile/1"
# Config fields that do not change the network's function (or are not stable across loads).
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures",
                         "_attn_implementation", "_attn_implementation_autoset", "use_cache", "output_attentions",
                         "output_hidden_states", "return_dict", "name_or_path"}


@dataclass(slots=True)
class LisConfig:
    alpha1: float = 0.25       # LTS weight
    alpha2: float = 0.25       # LRS weight
    beta: float = 0.5          # MDS weight
    samples: int = 8           # calibration sequences
    seq_len: int = 512         # tokens per calibration sequence
    seed: int = 0              # picks the calibration windows and the AWQ loss tokens
    mds_samples: int = 2       # sequences used for the greedy MDS (<= samples)
    refresh: int = 3           # lazy-greedy re-scorings per step; 0 = re-score all (Algorithm 1 verbatim)

    def __post_init__(self):
        for name in ("alpha1", "alpha2", "beta"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value} must be in [0, 1]")
        if self.alpha1 + self.alpha2 + self.beta <= 0:
            raise ValueError("alpha1 + alpha2 + beta must be > 0")
        if self.samples < 1:
            raise ValueError(f"samples={self.samples} must be >= 1")
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len} must be >= 2")
        if not 1 <= self.mds_samples:
            raise ValueError(f"mds_samples={self.mds_samples} must be >= 1")
        self.mds_samples = min(self.mds_samples, self.samples)
        if self.refresh < 0:
            raise ValueError(f"refresh={self.refresh} must be >= 0 (0 = re-score every candidate every step)")


def fallback_order(num_layers: int) -> list[int]:
    """Front-to-back: MorphServe's default when a model has no profile (Appendix A.3, Table 8)."""
    return list(range(num_layers))


def config_hash(hf_config) -> str:
    data = {k: v for k, v in hf_config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def calibration_batch(token_ids: torch.Tensor, samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """`samples` random non-overlapping windows of `seq_len` tokens from token_ids [num_tokens], fixed by seed.
    Returns [samples, seq_len]."""
    num_windows = token_ids.numel() // seq_len
    if num_windows < samples:
        raise ValueError(f"calibration text has {token_ids.numel()} tokens: {num_windows} windows of seq_len="
                         f"{seq_len}, but samples={samples} were requested; lower --samples or --seq-len")
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randperm(num_windows, generator=generator)[:samples].sort().values
    windows = token_ids[: num_windows * seq_len].reshape(num_windows, seq_len)
    return windows[picks].clone()


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float(), b.float(), dim=-1).mean().item()  # mean over tokens


@dataclass(slots=True)
class LisStep:
    step: int
    layer: int
    lts: float
    lrs: float
    mds: float
    lis: float


@dataclass(slots=True)
class LisProfile:
    model_id: str
    config_hash: str
    num_layers: int
    scheme: QuantScheme
    config: LisConfig
    order: list[int]
    steps: list[LisStep]
    lts: list[float]
    lrs: list[float]
    timings: dict[str, float] = field(default_factory=dict)
    calib_file: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "format": PROFILE_FORMAT,
            "model_id": self.model_id,
            "config_hash": self.config_hash,
            "num_layers": self.num_layers,
            "quant_scheme": self.scheme.to_dict(),
            "weights": {"alpha1": self.config.alpha1, "alpha2": self.config.alpha2, "beta": self.config.beta},
            "calibration": {"file": self.calib_file, "samples": self.config.samples, "seq_len": self.config.seq_len,
                            "seed": self.config.seed, "mds_samples": self.config.mds_samples,
                            "refresh": self.config.refresh},
            "order": self.order,
            "steps": [{"step": s.step, "layer": s.layer, "lts": s.lts, "lrs": s.lrs, "mds": s.mds, "lis": s.lis}
                      for s in self.steps],
            "lts": self.lts,
            "lrs": self.lrs,
            "timings": self.timings,
            **self.extra,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def load_profile(path: str | Path, hf_config=None) -> LisProfile:
    """Read a profile JSON; with hf_config, check that it belongs to this model (layer count, config hash)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"LIS profile {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"LIS profile {path} is not valid JSON: {exc}") from None
    if data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path} is not an LIS profile (format={data.get('format')!r}, expected {PROFILE_FORMAT!r})")
    num_layers = int(data["num_layers"])
    order = [int(i) for i in data["order"]]
    if sorted(order) != list(range(num_layers)):
        raise ValueError(f"LIS profile {path}: order must be a permutation of 0..{num_layers - 1}, got {order}")
    if hf_config is not None:
        if num_layers != hf_config.num_hidden_layers:
            raise ValueError(f"LIS profile {path} is for a {num_layers}-layer model; this model has "
                             f"{hf_config.num_hidden_layers} layers")
        expected = config_hash(hf_config)
        if data["config_hash"] != expected:
            raise ValueError(f"LIS profile {path} was made for config {data['config_hash']} "
                             f"(model {data.get('model_id')!r}); this model's config hash is {expected}. "
                             "Re-run `elastic-hf profile` for this model")
    calib = data.get("calibration", {})
    weights = data.get("weights", {})
    config = LisConfig(alpha1=weights.get("alpha1", 0.25), alpha2=weights.get("alpha2", 0.25),
                       beta=weights.get("beta", 0.5), samples=calib.get("samples", 8),
                       seq_len=calib.get("seq_len", 512), seed=calib.get("seed", 0),
                       mds_samples=calib.get("mds_samples", 2), refresh=calib.get("refresh", 0))
    steps = [LisStep(**s) for s in data.get("steps", [])]
    known = set(LisProfile.__slots__) | {"format", "quant_scheme", "weights", "calibration"}
    return LisProfile(model_id=data["model_id"], config_hash=data["config_hash"], num_layers=num_layers,
                      scheme=QuantScheme.from_dict(data["quant_scheme"]), config=config, order=order, steps=steps,
                      lts=data.get("lts", []), lrs=data.get("lrs", []), timings=data.get("timings", {}),
                      calib_file=calib.get("file", ""), extra={k: v for k, v in data.items() if k not in known})


@dataclass(slots=True)
class LisResult:
    profile: LisProfile
    variants: dict[int, nn.Module]    # layer index -> quantized decoder layer (int kernels)
    references: dict[int, nn.Module]  # layer index -> fp32 reference copy of the same variant


class _GreedyState:
    """Inputs of every layer under the current quantized set Q, for the MDS sequences."""

    def __init__(self, layers, references, final_norm, kwargs, inputs: list[torch.Tensor]):
        self.layers = layers
        self.references = references
        self.final_norm = final_norm
        self.kwargs = kwargs
        self.inputs = inputs                      # L + 1 tensors [mds_samples, seq, hidden]
        self.quantized: set[int] = set()
        self.output = final_norm(inputs[-1])      # f^(Q)(x) [mds_samples, seq, hidden]
        self.layer_forwards = 0

    def candidate(self, index: int) -> tuple[float, list[torch.Tensor]]:
        """MDS of quantizing `index` on top of Q, and the layer inputs after it (its trajectory)."""
        hidden = self.references[index](self.inputs[index], **self.kwargs)
        trajectory = [hidden]
        for i in range(index + 1, len(self.layers)):
            layer = self.references[i] if i in self.quantized else self.layers[i]
            hidden = layer(hidden, **self.kwargs)
            trajectory.append(hidden)
        self.layer_forwards += len(self.layers) - index
        return _cosine(self.output, self.final_norm(hidden)), trajectory

    def commit(self, index: int, trajectory: list[torch.Tensor]) -> None:
        self.quantized.add(index)
        self.inputs[index + 1:] = trajectory
        self.output = self.final_norm(self.inputs[-1])


@torch.no_grad()
def profile_lis(model: nn.Module, adapter, calib_ids: torch.Tensor, scheme: QuantScheme,
                config: LisConfig | None = None, awq_config: AwqConfig | None = None, model_id: str = "",
                calib_file: str = "", progress: bool = True,
                prebuilt: dict[int, nn.Module] | None = None) -> LisResult:
    """calib_ids [samples, seq_len] (see calibration_batch). Builds the quantized variant of every layer
    (RTN or AWQ on the same calibration data), or takes `prebuilt` ones (layer index -> quantized layer, e.g.
    loaded with load_layer_variant), then runs the greedy LIS selection."""
    config = config or LisConfig()
    awq_config = awq_config or AwqConfig(seed=config.seed)
    layers = adapter.decoder_layers(model)
    num_layers = len(layers)
    final_norm = model.get_submodule(adapter.final_norm)
    batch, seq_len = calib_ids.shape
    kwargs_all = decoder_layer_kwargs(model, batch, seq_len)
    kwargs_mds = decoder_layer_kwargs(model, config.mds_samples, seq_len)
    started = time.perf_counter()
    bar = tqdm(total=2 * num_layers, desc="LIS: quantize + LTS/LRS", disable=not progress, unit="layer")

    variants: dict[int, nn.Module] = {}
    references: dict[int, nn.Module] = {}
    lts, lrs = [], []
    hidden = model.get_submodule(adapter.embed_tokens)(calib_ids).float()  # [samples, seq, hidden]
    mds_inputs = [hidden[: config.mds_samples]]
    if prebuilt is not None and sorted(prebuilt) != list(range(num_layers)):
        raise ValueError(f"prebuilt variants cover layers {sorted(prebuilt)}; need all of 0..{num_layers - 1}")
    for i, layer in enumerate(layers):
        if prebuilt is not None:
            variant, reference, output = prebuilt[i], reference_layer(prebuilt[i]), None
        else:
            calibrated = calibrate_and_quantize(layer, adapter, model.config, scheme, hidden, kwargs_all,
                                                awq_config, with_reference=True)
            variant, reference, output = calibrated.quantized, calibrated.reference, calibrated.fp_output
        if output is None:
            output = layer(hidden, **kwargs_all)
        quantized_output = reference(hidden, **kwargs_all)
        lts.append(_cosine(output, hidden))
        lrs.append(_cosine(output, quantized_output))
        variants[i], references[i] = variant, reference
        hidden = output
        mds_inputs.append(hidden[: config.mds_samples])
        bar.update(1)
    calibrated_at = time.perf_counter()

    state = _GreedyState(layers, references, final_norm, kwargs_mds, mds_inputs)
    bar.set_description("LIS: greedy selection")
    stale: dict[int, float] = {}
    steps: list[LisStep] = []
    lis_of = lambda j, mds: config.alpha1 * lts[j] + config.alpha2 * lrs[j] + config.beta * mds  # noqa: E731
    for step in range(num_layers):
        candidates = [j for j in range(num_layers) if j not in state.quantized]
        # Highest stale LIS first; ties (and the first step) by layer index, so the order is deterministic.
        candidates.sort(key=lambda j: (-stale.get(j, float("inf")), j))
        exhaustive = config.refresh == 0 or step == 0
        best = None  # (lis, layer, mds, trajectory)
        for rank, j in enumerate(candidates):
            if not exhaustive and best is not None:
                if rank >= config.refresh or best[0] >= stale[j]:
                    break
            mds, trajectory = state.candidate(j)
            stale[j] = lis_of(j, mds)
            if best is None or stale[j] > best[0]:
                best = (stale[j], j, mds, trajectory)
        lis, chosen, mds, trajectory = best
        state.commit(chosen, trajectory)
        stale.pop(chosen)
        steps.append(LisStep(step=step, layer=chosen, lts=lts[chosen], lrs=lrs[chosen], mds=mds, lis=lis))
        bar.update(1)
    bar.close()
    finished = time.perf_counter()

    profile = LisProfile(
        model_id=model_id, config_hash=config_hash(model.config), num_layers=num_layers, scheme=scheme,
        config=config, order=[s.layer for s in steps], steps=steps, lts=lts, lrs=lrs, calib_file=calib_file,
        timings={"quantize_and_local_s": round(calibrated_at - started, 3),
                 "greedy_s": round(finished - calibrated_at, 3), "total_s": round(finished - started, 3),
                 "greedy_layer_forwards": state.layer_forwards})
    return LisResult(profile=profile, variants=variants, references=references)
