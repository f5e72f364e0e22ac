"""The LIS profile file (MorphServe §4.2): what `elastic-hf profile` writes and precision morphing reads at run
time (the swap order), plus the LIS score itself (eq. 5 on normalised terms). Runtime morphing imports only this
module and `calibration` from the profiling package; the greedy lives in `lis.py`."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from elastic_hf.layers.quant_scheme import QuantScheme

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
