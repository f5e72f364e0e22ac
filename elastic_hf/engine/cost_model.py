"""The micro-batch cost model of KunServe §4.3 (eq. 1-3), torch-free: how long one forward of a micro-batch of
chunks takes, fitted offline by least squares on measured forwards (`elastic-hf profile-cost`).

A chunk c of a request with p tokens already in the KV cache costs (eq. 1)

    cost(c) = alpha * (p*c + c^2 + c) + beta * c + gamma        prefix-attn + self-attn, linears, per chunk

and a micro-batch b of chunks shares its parameter reads (eq. 3)

    cost(b) = sum_c cost(c) - (|b| - 1) * lam.

We split that into two parts a pipeline stage pays differently:

- the *decoder part*: eq. 1-3 as written, for all decoder layers of the profiled model (its per-step fixed costs,
  metadata and the embedding lookup, ride along in gamma and lam). A stage holding k of the N layers pays k/N of it.
- the *head part*: `head` seconds per row that goes through the final norm and the LM head (a chunk that ends with
  a sampled row), plus `head_fixed` once per micro-batch that samples any row (streaming the LM head's weights:
  SmolLM2's 49k x 576 head is as many bytes as 8 of its decoder layers). Only the last stage pays it, so it is a
  term of its own, not folded into beta and lam: a pipeline's split and its micro-batches balance the stages by it.
  `elastic-hf profile-cost` times the head alone (a regression on whole forwards cannot tell a fixed head cost
  from lam: both are paid by nearly every micro-batch) and fits the decoder terms to the rest of each forward.

`fit_token_linear` is the baseline that token-count chunking assumes (time = a * tokens + b)."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

FORMAT = 1   # the "format" key of the JSON file; bump on an incompatible change
MIN_TOKENS_WORK_PER_FIXED = 1.0   # see choose_min_tokens
MAX_MIN_TOKENS = 4096
MAX_CONDITION = 1e8   # of the column-scaled design matrix; beyond it a coefficient is noise times a large factor


@dataclass(frozen=True, slots=True)
class Chunk:
    prefix: int             # tokens of the request already in the KV cache before this chunk
    tokens: int             # new tokens of the chunk (1: a decode)
    sampled: bool = False   # the chunk ends with a row through the LM head


def attention_work(chunk: Chunk) -> int:
    """The attention term of eq. 1: query-key pairs against the prefix (p*c) and within the chunk (c^2 + c)."""
    return chunk.prefix * chunk.tokens + chunk.tokens * chunk.tokens + chunk.tokens


@dataclass(frozen=True)
class CostModel:
    """Coefficients in seconds (eq. 1-3) for one model on one machine. `min_tokens` is MIN of Fig. 11: a
    micro-batch with fewer tokens wastes the device on fixed costs (see choose_min_tokens)."""
    alpha: float        # per query-key pair of attention, all decoder layers
    beta: float         # per token: the linears (QKV/O projections, MLP), all decoder layers
    gamma: float        # per chunk
    lam: float          # shared per extra chunk of a micro-batch (eq. 3)
    head: float         # per sampled row: final norm + LM head
    num_layers: int     # decoder layers of the profiled model
    min_tokens: int
    source: str = ""    # model id and machine
    head_fixed: float = 0.0   # per micro-batch that samples any row: the LM head's weight stream

    def __post_init__(self):
        for name in ("alpha", "beta", "gamma", "lam", "head", "head_fixed"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"cost model coefficient {name} must be finite and >= 0, got {value}")
        if self.num_layers < 1 or self.min_tokens < 1:
            raise ValueError(f"cost model needs num_layers >= 1 and min_tokens >= 1, got {self.num_layers} and "
                             f"{self.min_tokens}")

    def chunk_cost(self, chunk: Chunk) -> float:
        """Eq. 1 for the whole model, plus the head row when the chunk samples."""
        return self.decoder_cost([chunk]) + self.head_cost([chunk])

    def decoder_cost(self, chunks: list[Chunk]) -> float:
        """Eq. 3 over all decoder layers; 0 for an empty micro-batch."""
        if not chunks:
            return 0.0
        work = sum(self.alpha * attention_work(c) + self.beta * c.tokens for c in chunks)
        return work + len(chunks) * self.gamma - (len(chunks) - 1) * self.lam

    def head_cost(self, chunks: list[Chunk]) -> float:
        rows = sum(c.sampled for c in chunks)
        return self.head * rows + (self.head_fixed if rows else 0.0)

    def batch_cost(self, chunks: list[Chunk], layer_fraction: float = 1.0, last_stage: bool = True) -> float:
        """One micro-batch on a pipeline stage holding `layer_fraction` of the decoder layers; only the last stage
        pays the LM head rows."""
        head = self.head_cost(chunks) if last_stage else 0.0
        return layer_fraction * self.decoder_cost(chunks) + head

    # ------------------------------------------------------------------ file format
    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "kind": "cost-model", **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"a cost model file is JSON; this is not ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("kind") != "cost-model":
            got = (data.get("kind"), data.get("format")) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a cost model of format {FORMAT}: kind/format {got}")
        fields = ("alpha", "beta", "gamma", "lam", "head", "num_layers", "min_tokens")
        missing = [name for name in fields if name not in data]
        if missing:
            raise ValueError(f"cost model file misses {missing}")
        return cls(*(float(data[n]) for n in fields[:5]), int(data["num_layers"]), int(data["min_tokens"]),
                   str(data.get("source", "")), float(data.get("head_fixed", 0.0)))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"cost model {path} does not exist: write one with `elastic-hf profile-cost`")
        try:
            return cls.from_json(path.read_text())
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None


SHIPPED_PROFILES = Path(__file__).resolve().parents[1] / "data" / "cost_profiles"


def shipped_cost_model(model_id: str, dtype: str) -> CostModel | None:
    """The cost model shipped for `model_id` at `dtype` (data/cost_profiles/<model id>.<dtype>.json, fitted by
    `elastic-hf profile-cost --grid small` on a 2-core x86 CPU), or None. Lookahead balances micro-batches by the
    *ratios* of its coefficients, which carry over between machines far better than its seconds."""
    path = SHIPPED_PROFILES / f"{model_id}.{dtype}.json"
    return CostModel.load(path) if path.is_file() else None


@dataclass(frozen=True)
class TokenLinearModel:
    """The baseline: time = per_token * tokens + fixed, blind to attention and to where a chunk sits in its
    request. Same interface as CostModel.batch_cost (it does not tell the head apart, so last_stage is unused)."""
    per_token: float
    fixed: float

    def batch_cost(self, chunks: list[Chunk], layer_fraction: float = 1.0, last_stage: bool = True) -> float:
        if not chunks:
            return 0.0
        return layer_fraction * (self.per_token * sum(c.tokens for c in chunks) + self.fixed)


Sample = tuple[list[Chunk], float]   # a micro-batch and its measured seconds


def eq3_features(chunks: list[Chunk]) -> list[float]:
    """The regressors of `fit`, in the order of its coefficients."""
    return [sum(attention_work(c) for c in chunks), sum(c.tokens for c in chunks), len(chunks), 1.0,
            sum(c.sampled for c in chunks)]


def fit(samples: list[Sample], num_layers: int, *, source: str = "", min_tokens: int | None = None,
        head: tuple[float, float] | None = None) -> CostModel:
    """Least squares (KunServe §4.3) of eq. 1-3 on measured micro-batches.

    head: (fixed, per row) seconds of the head part measured on its own (fit_head); each sample's head time is then
    taken off its measured time and only the decoder terms are fitted. Without it the head's per-row cost is a
    fifth coefficient of the regression and its fixed cost rides in lam.

    gamma and lam are not identifiable as written: cost(b) holds |b|*gamma - (|b|-1)*lam = (gamma - lam)*|b| + lam,
    so the regression is linear in [attention work, tokens, |b|, 1, sampled rows] with coefficients
    [alpha, beta, gamma - lam, lam, head], and gamma = (gamma - lam) + lam. lam is the intercept: the cost of a
    forward whatever it holds (on a CPU mostly streaming the weights), which eq. 3 lets a batch pay once.

    Residuals are relative (rows scaled by 1/time), so a 20 ms decode batch weighs as much as a 2 s prefill: the
    balance of micro-batches depends on relative errors. A negative coefficient is noise around a small true
    value (alpha on a model whose attention is a sliver of its linears at the profiled lengths); a cost model with
    one would prefer longer prefixes or larger batches (and gamma < lam would make one more chunk shrink a
    micro-batch's cost), so the most negative is fixed at 0 and the rest refitted until none is (an active-set
    non-negative least squares)."""
    if head is None:
        return fit_features([eq3_features(chunks) for chunks, _ in samples], [t for _, t in samples], num_layers,
                            source=source, min_tokens=min_tokens, unit="micro-batches")
    head_fixed, per_row = head
    probe = CostModel(0.0, 0.0, 0.0, 0.0, per_row, num_layers, 1, head_fixed=head_fixed)
    rest = [t - probe.head_cost(chunks) for chunks, t in samples]
    if min(rest) <= 0:
        worst = min(range(len(rest)), key=rest.__getitem__)
        raise ValueError(f"the measured head ({head_fixed:.4g} s + {per_row:.4g} s a row) takes all of a "
                         f"{samples[worst][1]:.4g} s micro-batch of {len(samples[worst][0])} chunks: the head and "
                         f"the forwards were not timed alike")
    model = fit_features([eq3_features(chunks)[:4] for chunks, _ in samples], rest, num_layers, source=source,
                         min_tokens=min_tokens, unit="micro-batches")
    return replace(model, head=per_row, head_fixed=head_fixed)


def fit_head(timings: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed, per row) seconds of the head part from (rows, seconds) timings of the final norm + LM head alone: a
    non-negative straight-line fit (relative residuals, as `fit`)."""
    if len({rows for rows, _ in timings}) < 2:
        raise ValueError(f"fitting the head needs timings at >= 2 row counts, got {sorted({r for r, _ in timings})}")
    per_row, fixed = _fit_line(timings, "head rows", "head timings")
    return fixed, per_row


def _fit_line(points: list[tuple[float, float]], x_name: str, what: str) -> tuple[float, float]:
    """(slope, intercept) of seconds = slope * x + intercept over (x, seconds) points: relative residuals, both
    clamped at 0 (the least squares of `fit` on two regressors)."""
    times = np.array([t for _, t in points], dtype=np.float64)
    if np.any(times <= 0):
        raise ValueError(f"{what} must be > 0; got min {times.min()}")
    features = np.array([[float(x), 1.0] for x, _ in points], dtype=np.float64)
    slope, intercept = _nonnegative_lstsq(features / times[:, None], np.ones_like(times), [x_name, "intercept"])
    return float(slope), float(intercept)


def fit_features(rows: list[list[float]], seconds: list[float], num_layers: int, *, source: str = "",
                 min_tokens: int | None = None, unit: str = "samples") -> CostModel:
    """`fit` on precomputed regressor rows (eq3_features of a micro-batch, or sums of them scaled by a stage's
    share of the layers: engine/cost_fit.py) and their measured seconds. Rows of 4 (the decoder terms only: the
    head timed apart) fit a model with no head cost."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    num_coefficients = len(rows[0]) if rows else 5
    if num_coefficients not in (4, 5) or any(len(row) != num_coefficients for row in rows):
        raise ValueError(f"regressor rows must all have 4 or 5 values, got lengths {sorted({len(r) for r in rows})}")
    if len(rows) < 2 * num_coefficients:
        raise ValueError(f"fitting {num_coefficients} coefficients needs at least {2 * num_coefficients} measured "
                         f"{unit}, got {len(rows)}")
    times = np.array(seconds, dtype=np.float64)
    if not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise ValueError(f"measured times must be finite and > 0; got min {times.min()} max {times.max()}")
    features = np.array(rows, dtype=np.float64)
    coefficients = _nonnegative_lstsq(features / times[:, None], np.ones_like(times),
                                      ["attention work", "tokens", "chunks", "intercept", "sampled rows"]
                                      [:num_coefficients])
    alpha, beta, gamma_minus_lam, lam, head = (*(float(v) for v in coefficients), 0.0)[:5]
    model = CostModel(alpha, beta, gamma_minus_lam + lam, lam, head, num_layers,
                      1 if min_tokens is None else min_tokens, source)
    return model if min_tokens is not None else replace(model, min_tokens=choose_min_tokens(model))


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray, names: list[str]) -> np.ndarray:
    scale = np.abs(a).max(axis=0)
    zero = [names[i] for i in np.flatnonzero(scale == 0)]
    if zero:
        raise ValueError(f"no sample has any {zero}: the cost model cannot be fitted (profile micro-batches "
                         f"with attention, several chunks and sampled rows)")
    scaled = a / scale   # columns in [-1, 1]: the condition number then measures collinearity, not units
    singular = np.linalg.svd(scaled, compute_uv=False)
    condition = singular[0] / singular[-1] if singular[-1] > 0 else math.inf
    if condition > MAX_CONDITION:
        raise ValueError(f"the samples do not determine the {a.shape[1]} coefficients {names} (condition number "
                         f"{condition:.3g} > {MAX_CONDITION:.0g}): vary prefix, chunk size, chunks per micro-batch "
                         f"and sampled rows independently")
    active = list(range(a.shape[1]))
    while True:
        solution, *_ = np.linalg.lstsq(scaled[:, active], b, rcond=None)
        if solution.min() >= 0:
            break
        active.pop(int(np.argmin(solution)))
        if not active:
            raise ValueError("every coefficient of the cost model fits negative: the timings do not grow with work")
    out = np.zeros(a.shape[1])
    out[active] = solution
    return out / scale


def choose_min_tokens(model: CostModel, work_per_fixed: float = MIN_TOKENS_WORK_PER_FIXED) -> int:
    """MIN of Fig. 11: the fewest tokens c of a fresh one-chunk micro-batch whose token work (beta*c +
    alpha*(c^2 + c)) is at least `work_per_fixed` times its fixed cost (gamma): where the per-token cost
    gamma/c + beta + alpha*(c + 1) has come within 2x of its floor and stops falling fast.

    Why 1.0: a micro-batch of work 2w and fixed cost o takes 2w + o on a 2-stage pipeline that runs it alone,
    and (3/2)(w + o) as two micro-batches of w (three pipeline slots of half the layers each); splitting wins
    only when w > o, i.e. when each half's token work exceeds its fixed cost. Capped at MAX_MIN_TOKENS."""
    for tokens in range(1, MAX_MIN_TOKENS + 1):
        if model.beta * tokens + model.alpha * (tokens * tokens + tokens) >= work_per_fixed * model.gamma:
            return tokens
    return MAX_MIN_TOKENS


def fit_token_linear(samples: list[Sample]) -> TokenLinearModel:
    """time = per_token * tokens + fixed by the same relative least squares as `fit` (both clamped at 0)."""
    if len(samples) < 2:
        raise ValueError(f"fitting time = a * tokens + b needs at least 2 measured micro-batches, got {len(samples)}")
    per_token, fixed = _fit_line([(sum(c.tokens for c in chunks), t) for chunks, t in samples], "tokens",
                                 "measured times")
    return TokenLinearModel(per_token, fixed)


def relative_errors(model, samples: list[Sample]) -> list[float]:
    """|predicted - measured| / measured per sample (model: CostModel or TokenLinearModel)."""
    return [abs(model.batch_cost(chunks) - t) / t for chunks, t in samples]
