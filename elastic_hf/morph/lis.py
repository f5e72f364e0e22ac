"""LIS layer profiling (MorphServe §4.2, Appendix A, Algorithm 1): the order in which to swap decoder layers to
their quantized variant.

    LTS_p = cos(h_p(x), x_p)                   layer transformation sensitivity  (eq. 2)
    LRS_p = cos(h_p(x), h_p^Q(x))              layer replacement sensitivity     (eq. 3)
    MDS_p = cos(f^(Q)(x), f^(Q u {p})(x))      model degradation sensitivity     (eq. 4)
    LIS_p = a1 * LTS_p + a2 * LRS_p + b * MDS_p                                  (eq. 5)

Normalisation (`normalize`): the three cosines live on very different scales. On SmolLM2-135M (W4 AWQ) LTS
spans 0.02-0.97 across layers while MDS spans 0.9980-0.9996, about 100x less, so with the raw sum the order is
"highest LTS first" whatever the weights say. With normalize="minmax" each term is mapped to
[0, 1] by its spread over the layers before weighting, LIS_p = a1 * N(LTS_p) + a2 * N(LRS_p) + b * N(MDS_p),
so a1/a2/b really are the terms' shares (the default); "zscore" divides by the standard deviation instead;
"none" is eq. 5 on the raw cosines. The maps are fixed once: LTS/LRS over all layers, MDS over
the first greedy step (which scores every layer). A fixed affine map per term keeps the lazy greedy's stale
scores comparable with fresh ones (renormalising over the remaining candidates every step would change every
stale score); later MDS values may fall slightly outside [0, 1]. The maps are stored in the profile JSON
("normalization"), with every layer's first-step MDS ("first_mds").

MDS metric (`mds_metric`): "cosine" compares final normed hidden states as described above; "kl" runs the LM
head and uses exp(-KL(p_Q || p_Q+p)) of the next-token distributions, per token, averaged (1 = identical, like a
cosine); "nll" (the default) also runs the LM head and scores the calibration tokens themselves:
exp(NLL_Q - NLL_Q+p), the perplexity ratio (1 = no change, > 1 = quantizing p even lowers the calibration
perplexity). KL penalises any change of the distribution, NLL only the changes that cost likelihood, which is what
Table 8 measures on held-out text.

Measured on SmolLM2-135M (W4 g64 AWQ, calibrated on the first half of wikitext2-valid, perplexity on 32 x 512
tokens of the second half, fp32 30.78), k = 4 / 8 / 16 quantized layers:
    front-to-back                 31.37 / 31.79 / 32.43
    random (mean of 3 orders)     31.21 / 31.91 / 32.86
    none + cosine (raw eq. 5)     31.33 / 31.76 / 32.45
    minmax + cosine               31.23 / 31.58 / 32.40
    minmax + kl                   31.32 / 31.37 / 32.04
    minmax + nll, 2 MDS sequences 31.21 / 31.38 / 31.86
    minmax + nll, 4 MDS sequences 30.84 / 31.07 / 31.78   (the default)
Only the nll variants are no worse than both baselines at every k; 4 sequences make the NLL differences between
layers stand out of the sampling noise (2 and 4 sequences pick different orders).

Cosines are per token over the hidden dimension, averaged over all calibration tokens. f(x) is the final
normed hidden state (the LM head's input) unless mds_metric is "kl" or "nll".

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
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from elastic_hf.layers.awq import AwqConfig
from elastic_hf.layers.cpu_gemm import use_onednn_linears
from elastic_hf.layers.quant_scheme import QuantScheme
from elastic_hf.layers.quantize_layer import calibrate_and_quantize, decoder_layer_kwargs, reference_layer

PROFILE_FORMAT = "elastic-hf-lis-profile/1"
NORMALIZATIONS = ("minmax", "zscore", "none")
MDS_METRICS = ("cosine", "kl", "nll")
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
    mds_samples: int = 4       # sequences used for the greedy MDS (<= samples)
    refresh: int = 3           # lazy-greedy re-scorings per step; 0 = re-score all (Algorithm 1 verbatim)
    normalize: str = "minmax"  # per-term scaling before weighting: minmax, zscore or none (raw eq. 5)
    mds_metric: str = "nll"    # MDS similarity: cosine of final normed hidden states; kl: exp(-KL) of the
                               # next-token distributions (the LM head's output); nll: exp(NLL_Q - NLL_Q+p) of
                               # the calibration tokens themselves (the perplexity ratio)

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
        if self.mds_metric not in MDS_METRICS:
            raise ValueError(f"mds_metric={self.mds_metric!r} is not one of {', '.join(MDS_METRICS)}")
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize={self.normalize!r} is not one of {', '.join(NORMALIZATIONS)}")


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


def term_scale(values: list[float], method: str) -> tuple[float, float]:
    """(center, scale) of the fixed map x -> (x - center) / scale that normalises one LIS term over `values`:
    minmax -> (min, max - min), zscore -> (mean, population std), none -> (0, 1). A constant term (zero spread)
    gets scale 1, so it adds the same value to every layer and does not affect the order."""
    if method == "none" or not values:
        return 0.0, 1.0
    if method == "minmax":
        center, spread = min(values), max(values) - min(values)
    elif method == "zscore":
        center = sum(values) / len(values)
        spread = (sum((v - center) ** 2 for v in values) / len(values)) ** 0.5
    else:
        raise ValueError(f"normalize={method!r} is not one of {', '.join(NORMALIZATIONS)}")
    return center, spread if spread > 1e-12 else 1.0


def lis_score(config: "LisConfig", normalization: dict[str, list[float]], lts: float, lrs: float,
              mds: float) -> float:
    """eq. 5 on the normalised terms; normalization maps "lts"/"lrs"/"mds" to (center, scale) (see term_scale)."""
    n = lambda term, x: (x - normalization[term][0]) / normalization[term][1]  # noqa: E731
    return config.alpha1 * n("lts", lts) + config.alpha2 * n("lrs", lrs) + config.beta * n("mds", mds)


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
    normalization: dict[str, list[float]] = field(default_factory=dict)  # term -> [center, scale]
    first_mds: list[float] = field(default_factory=list)  # step-1 MDS of every layer (defines the MDS map)

    def lis(self, lts: float, lrs: float, mds: float) -> float:
        """The LIS this profile's greedy used for these term values."""
        normalization = self.normalization or {term: [0.0, 1.0] for term in ("lts", "lrs", "mds")}
        return lis_score(self.config, normalization, lts, lrs, mds)

    def to_dict(self) -> dict:
        return {
            "format": PROFILE_FORMAT,
            "model_id": self.model_id,
            "config_hash": self.config_hash,
            "num_layers": self.num_layers,
            "quant_scheme": self.scheme.to_dict(),
            "weights": {"alpha1": self.config.alpha1, "alpha2": self.config.alpha2, "beta": self.config.beta},
            "normalize": self.config.normalize,
            "normalization": self.normalization,
            "calibration": {"file": self.calib_file, "samples": self.config.samples, "seq_len": self.config.seq_len,
                            "seed": self.config.seed, "mds_samples": self.config.mds_samples,
                            "refresh": self.config.refresh, "mds_metric": self.config.mds_metric},
            "order": self.order,
            "steps": [{"step": s.step, "layer": s.layer, "lts": s.lts, "lrs": s.lrs, "mds": s.mds, "lis": s.lis}
                      for s in self.steps],
            "lts": self.lts,
            "lrs": self.lrs,
            "first_mds": self.first_mds,
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
                       mds_samples=calib.get("mds_samples", 2), refresh=calib.get("refresh", 0),
                       # profiles written before these options used raw eq. 5 with the hidden-state cosine
                       normalize=data.get("normalize", "none"), mds_metric=calib.get("mds_metric", "cosine"))
    steps = [LisStep(**s) for s in data.get("steps", [])]
    known = set(LisProfile.__slots__) | {"format", "quant_scheme", "weights", "calibration", "normalize"}
    return LisProfile(model_id=data["model_id"], config_hash=data["config_hash"], num_layers=num_layers,
                      scheme=QuantScheme.from_dict(data["quant_scheme"]), config=config, order=order, steps=steps,
                      lts=data.get("lts", []), lrs=data.get("lrs", []), timings=data.get("timings", {}),
                      calib_file=calib.get("file", ""), extra={k: v for k, v in data.items() if k not in known},
                      normalization=data.get("normalization", {}), first_mds=data.get("first_mds", []))


@dataclass(slots=True)
class LisResult:
    profile: LisProfile
    variants: dict[int, nn.Module]    # layer index -> quantized decoder layer (int kernels)
    references: dict[int, nn.Module]  # layer index -> fp32 reference copy of the same variant


class _GreedyState:
    """Inputs of every layer under the current quantized set Q, for the MDS sequences."""

    def __init__(self, layers, references, final_norm, kwargs, inputs: list[torch.Tensor], lm_head=None,
                 labels: torch.Tensor | None = None):
        self.layers = layers
        self.references = references
        self.final_norm = final_norm
        self.lm_head = lm_head                    # set: MDS compares next-token distributions (kl) or NLLs (nll)
        self.labels = labels                      # [mds_samples, seq_len - 1] next tokens: mds_metric="nll"
        self.kwargs = kwargs
        self.inputs = inputs                      # L + 1 tensors [mds_samples, seq, hidden]
        self.quantized: set[int] = set()
        self.output = self.model_output(inputs[-1])  # f^(Q)(x)
        self.layer_forwards = 0

    def model_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """f(x): the final normed hidden state [.., hidden]; with lm_head the log-probabilities [.., vocab]; with
        labels the mean negative log-likelihood of the calibration tokens (a 0-d tensor)."""
        normed = self.final_norm(hidden)
        if self.lm_head is None:
            return normed
        if self.labels is not None:
            logits = self.lm_head(normed[:, :-1]).float()                          # [samples, seq - 1, vocab]
            return F.cross_entropy(logits.flatten(0, 1), self.labels.flatten())
        return self.lm_head(normed).float().log_softmax(-1)

    def similarity(self, output: torch.Tensor) -> float:
        if self.lm_head is None:
            return _cosine(self.output, output)
        if self.labels is not None:
            # perplexity ratio ppl_Q / ppl_Q+p: 1 when the candidate changes nothing, > 1 when it even helps
            return math.exp((self.output - output).item())
        # exp(-KL(p_Q || p_Q+p)), KL per token averaged: 1 for identical distributions, like a cosine
        kl = F.kl_div(output, self.output, log_target=True, reduction="none").sum(-1).mean().item()
        return math.exp(-kl)

    def candidate(self, index: int) -> tuple[float, list[torch.Tensor], torch.Tensor]:
        """MDS of quantizing `index` on top of Q, the layer inputs after it (its trajectory) and f^(Q u {index})."""
        hidden = self.references[index](self.inputs[index], **self.kwargs)
        trajectory = [hidden]
        for i in range(index + 1, len(self.layers)):
            layer = self.references[i] if i in self.quantized else self.layers[i]
            hidden = layer(hidden, **self.kwargs)
            trajectory.append(hidden)
        self.layer_forwards += len(self.layers) - index
        output = self.model_output(hidden)
        return self.similarity(output), trajectory, output

    def commit(self, index: int, trajectory: list[torch.Tensor], output: torch.Tensor) -> None:
        """Move `index` into Q with the trajectory and output its candidate() computed (no LM head re-run)."""
        self.quantized.add(index)
        self.inputs[index + 1:] = trajectory
        self.output = output


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

    # The greedy only runs forwards: fp32 linears switch to oneDNN where it is faster (layers/cpu_gemm.py). After
    # the calibration above, so the AWQ scales and LTS/LRS never depend on the GEMM backend.
    use_onednn_linears(model, *references.values())
    lm_head = model.get_submodule(adapter.lm_head) if config.mds_metric in ("kl", "nll") else None
    labels = calib_ids[: config.mds_samples, 1:] if config.mds_metric == "nll" else None
    state = _GreedyState(layers, references, final_norm, kwargs_mds, mds_inputs, lm_head, labels)
    bar.set_description("LIS: greedy selection")
    stale: dict[int, float] = {}
    steps: list[LisStep] = []
    normalization = {"lts": list(term_scale(lts, config.normalize)), "lrs": list(term_scale(lrs, config.normalize))}
    first_mds: list[float] = []
    for step in range(num_layers):
        candidates = [j for j in range(num_layers) if j not in state.quantized]
        # Highest stale LIS first; ties (and the first step) by layer index, so the order is deterministic.
        candidates.sort(key=lambda j: (-stale.get(j, float("inf")), j))
        exhaustive = config.refresh == 0 or step == 0
        best = None  # (lis, layer, mds, trajectory, output)
        if step == 0:
            # Every layer is scored once with Q empty; their MDS spread fixes the MDS map for the whole run.
            # Only the MDS is kept (30 trajectories would not fit in memory); the winner's is recomputed.
            first_mds = [state.candidate(j)[0] for j in range(num_layers)]
            normalization["mds"] = list(term_scale(first_mds, config.normalize))
        for rank, j in enumerate(candidates):
            if not exhaustive and best is not None:
                if rank >= config.refresh or best[0] >= stale[j]:
                    break
            mds, trajectory, output = (first_mds[j], None, None) if step == 0 else state.candidate(j)
            stale[j] = lis_score(config, normalization, lts[j], lrs[j], mds)
            if best is None or stale[j] > best[0]:
                best = (stale[j], j, mds, trajectory, output)
        lis, chosen, mds, trajectory, output = best
        if trajectory is None:
            _, trajectory, output = state.candidate(chosen)
        state.commit(chosen, trajectory, output)
        stale.pop(chosen)
        steps.append(LisStep(step=step, layer=chosen, lts=lts[chosen], lrs=lrs[chosen], mds=mds, lis=lis))
        bar.update(1)
    bar.close()
    finished = time.perf_counter()

    profile = LisProfile(
        model_id=model_id, config_hash=config_hash(model.config), num_layers=num_layers, scheme=scheme,
        config=config, order=[s.layer for s in steps], steps=steps, lts=lts, lrs=lrs, calib_file=calib_file,
        normalization=normalization, first_mds=first_mds,
        timings={"quantize_and_local_s": round(calibrated_at - started, 3),
                 "greedy_s": round(finished - calibrated_at, 3), "total_s": round(finished - started, 3),
                 "greedy_layer_forwards": state.layer_forwards})
    return LisResult(profile=profile, variants=variants, references=references)
