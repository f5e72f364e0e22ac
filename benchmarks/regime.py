"""The papers' memory regime for the elastic benchmarks (morph_replay.py, param_drop.py, pp_serving.py).

KunServe (§5.1: parameters take 34-74 % of a GPU's memory), MorphServe and ReMP evaluate where an instance's weights
are a large but not overwhelming share of its memory. A benchmark that gives the KV cache a few MiB beside half a
GB of weights (weights ~97 % of memory) makes any freed layer multiply the KV capacity ten-fold; the numbers then
say nothing to a user sizing a deployment. Here the KV budget of an instance is derived from its measured weights:

    kv_bytes = weights_bytes x (1 - share) / share        (share = weights / (weights + KV))

so `--weight-share 0.5` gives the KV as many bytes as the weights, `0.3` 2.33x as many. A worker's budget is its
full-precision TP1 weights plus that KV, whatever layout it later takes (a pipeline stage holds part of the
layers and turns the rest of its budget into KV)."""
from __future__ import annotations

import statistics

DEFAULT_WEIGHT_SHARES = "0.5,0.3"


def add_weight_share_arg(parser, default: str = DEFAULT_WEIGHT_SHARES) -> None:
    parser.add_argument("--weight-share", default=default,
                        help="weights / (weights + KV) of a full-precision TP1 instance; comma-separated to run "
                             "several regimes one after another (KunServe §5.1: 0.34-0.74)")


def parse_weight_shares(text: str) -> list[float]:
    shares = [float(part) for part in str(text).split(",") if part.strip()]
    bad = [s for s in shares if not 0.0 < s < 1.0]
    if not shares or bad:
        raise ValueError(f"--weight-share needs values in (0, 1), got {text!r}")
    return shares


def kv_bytes_for_share(weights_bytes: int, share: float) -> int:
    """KV bytes that make `weights_bytes` the `share` of weights + KV."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"weight share must be in (0, 1), got {share}")
    return int(weights_bytes * (1.0 - share) / share)


def measured_weights_bytes(model) -> int:
    """Committed weight bytes of the model's largest worker (an ElasticModel; its ledger, not a parameter count)."""
    return max(w["weights_bytes"] for w in model.memory_report()["workers"])


def share_label(share: float) -> str:
    """A RESULT-name suffix: 0.5 -> 'ws50', 0.3 -> 'ws30'."""
    return f"ws{round(100 * share)}"


def median_spread(values: list[float], digits: int = 3) -> str:
    """'median [min-max]' of runs (a single run prints alone)."""
    vals = [v for v in values if v == v]   # drop NaN
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f}"
    return f"{statistics.median(vals):.{digits}f} [{min(vals):.{digits}f}-{max(vals):.{digits}f}]"


def median(values: list[float]) -> float:
    vals = [v for v in values if v == v]
    return statistics.median(vals) if vals else float("nan")
