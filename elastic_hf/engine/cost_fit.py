"""The micro-batch cost model fitted while serving (KunServe §4.3), for models without a profile: no
`--cost-profile` and none shipped in data/cost_profiles. A pipeline formed by an overload response (a parameter
drop) or set up statically starts on token-count micro-batches; every step its stages report how long their
forwards took (busy seconds, summed over the step's micro-batches), and each report is one sample of eq. 1-3:

    busy(stage) = sum over micro-batches b of  f * (alpha * attention(b) + beta * tokens(b) + (gamma - lam) * |b| + lam)
                  + head * sampled(b) on the last stage

with f the stage's share of the decoder layers. The coefficients are linear in these summed features, so the same
relative, non-negative least squares as `elastic-hf profile-cost` (engine/cost_model.fit) applies. Once enough
samples determine them (decode-only steps alone do not: they vary neither chunk sizes nor prefixes much), the
deployment switches the pipeline to lookahead micro-batches with the fitted model. Torch-free."""
from __future__ import annotations

from elastic_hf.engine.cost_model import Chunk, CostModel, eq3_features, fit_features

MIN_SAMPLES = 24        # stage reports before the first attempt (5 coefficients, at least twice as many samples)
REFIT_EVERY = 16        # new reports between attempts while the samples do not determine the model
MAX_SAMPLES = 2048      # the oldest reports go beyond this


class OnlineCostFit:
    def __init__(self, num_layers: int, source: str = ""):
        self.num_layers = num_layers
        self.source = source
        self.rows: list[list[float]] = []
        self.times: list[float] = []
        self._next_attempt = MIN_SAMPLES
        self.last_error: str | None = None   # why the last attempt did not fit, for the log

    def add(self, micro_batches: list[list[Chunk]], layer_fraction: float, last_stage: bool, seconds: float) -> None:
        """One stage's busy seconds over a step's micro-batches; the stage holds `layer_fraction` of the layers."""
        if seconds <= 0 or not micro_batches:
            return
        row = [0.0] * 5
        for chunks in filter(None, micro_batches):
            *decoder, sampled = eq3_features(chunks)   # the decoder terms scale with the layers, the head's do not
            row[:4] = [total + layer_fraction * value for total, value in zip(row, decoder)]
            row[4] += sampled if last_stage else 0.0
        self.rows.append(row)
        self.times.append(seconds)
        if len(self.rows) > MAX_SAMPLES:
            del self.rows[0], self.times[0]
            self._next_attempt -= 1

    @property
    def num_samples(self) -> int:
        return len(self.rows)

    def model(self) -> CostModel | None:
        """The fitted model once the samples determine it (tried every REFIT_EVERY new samples), else None."""
        if len(self.rows) < self._next_attempt:
            return None
        self._next_attempt = len(self.rows) + REFIT_EVERY
        try:
            return fit_features(self.rows, self.times, self.num_layers, source=self.source)
        except ValueError as exc:   # collinear or too uniform so far: more, more varied steps will come
            self.last_error = str(exc)
            return None
