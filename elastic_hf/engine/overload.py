"""One arbiter over the responses to KV overload (torch-free), so that they never fight:

- "morph": precision morphing (MorphServe) on every TP1 worker, by its own controller (KV use, queue delay);
- "tp-merge": merge data-parallel instances into a tensor-parallel one (AMOEBA/Gyges): its weights are sharded, so
  each worker gives half of them to the KV cache;
- "drop": parameter dropping (KunServe): replicated instances form a pipeline group that keeps one copy of each
  layer, and the freed pages become KV blocks;
- "auto": at the onset of an overload, morphing when what it can still add covers the deficit (it keeps the
  layout, costs no pipeline bubbles and no pause), else dropping (it frees the most), else a TP merge.

At most one response is active at a time. The overload is the monitor's memory demand (running plus queued
requests' blocks, as Llumnix counts it) above the capacity, held for `hold_steps` steps, or, once the demand is past
`predict_floor` of the capacity, the demand `lead_steps` ahead at its growth over the last SLOPE_WINDOW_STEPS steps
(KunServe acts when the system "has suffered or is about to suffer" an overload: a drop's KV exchange takes many
steps, and the layout should hold the burst when the exchange ends, not when it starts); a dropped or merged layout
is restored once the demand stays below `restore_below` of the undropped capacity for `restore_hold_steps` (KunServe
§4.4: 50 %), and nothing new starts for `cooldown_steps` after a restore, so a load hovering at a threshold does not
oscillate. Decisions are data; parallel/overload_control.py executes them."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from elastic_hf.config import OVERLOAD_RESPONSES, OverloadConfig

__all__ = ["OVERLOAD_RESPONSES", "OverloadArbiter", "OverloadConfig", "OverloadDecision", "OverloadSnapshot"]

RETRY_BACKOFF_STEPS = 16   # after a refused response (no plan, or rolled back)
# The demand's growth rate is its change over this many steps: long enough that one prompt's arrival or one
# request's end (a few blocks) is not a trend, short enough to see a burst's ramp within a few seconds.
SLOPE_WINDOW_STEPS = 32


@dataclass(frozen=True, slots=True)
class OverloadSnapshot:
    """KV in tokens (blocks x block size), so layouts with different block sizes in bytes compare."""
    demand_tokens: int          # held by running requests + needed by the queued ones' prompts
    capacity_tokens: int        # attached now, over every instance
    base_capacity_tokens: int   # of the configured layout at full precision (the undropped capacity)
    morph_headroom_tokens: int  # what quantizing the remaining fp layers could still add (0 without morphing)
    morphed: bool               # some layer runs below full precision

    @property
    def demand_ratio(self) -> float:
        return self.demand_tokens / max(self.capacity_tokens, 1)


@dataclass(frozen=True, slots=True)
class OverloadDecision:
    action: str     # "drop" | "tp-merge" | "morph" (enable the morph controllers) | "restore" | "morph-done"
    reason: str
    need_tokens: int = 0   # KV tokens the response should add: the (projected) demand over the capacity


class OverloadArbiter:
    def __init__(self, policy: OverloadConfig, has_morph: bool, can_reshape: bool):
        self.policy = policy
        self.has_morph = has_morph
        self.can_reshape = can_reshape
        self.active: str | None = None     # the response in effect: "morph", "drop" or "tp-merge"
        self._over = 0
        self._under = 0
        self._cooldown = 0
        self._demands: deque[int] = deque(maxlen=SLOPE_WINDOW_STEPS + 1)   # the last steps' demand, oldest first
        self.projected_tokens = 0   # the demand lead_steps ahead, as of the last decide()

    def project(self, demand_tokens: int) -> int:
        """The demand `lead_steps` ahead at its growth over the last SLOPE_WINDOW_STEPS steps; never below the
        demand now (a falling demand predicts nothing), the demand itself until the window has filled."""
        self._demands.append(demand_tokens)
        if len(self._demands) <= SLOPE_WINDOW_STEPS or self.policy.lead_steps == 0:
            return demand_tokens
        growth = (demand_tokens - self._demands[0]) / SLOPE_WINDOW_STEPS   # tokens a step
        return demand_tokens + max(0, round(growth * self.policy.lead_steps))

    @property
    def morph_controllers_on(self) -> bool:
        """Whether the morph controllers may act: always in "morph" mode, in "auto" only while morphing is the
        chosen response."""
        return self.policy.mode == "morph" or (self.policy.mode == "auto" and self.active == "morph")

    def decide(self, snap: OverloadSnapshot) -> OverloadDecision | None:
        """Called at every step boundary; returns what to do now, or None. The caller reports back with
        `done(action, ok)`."""
        mode, p = self.policy.mode, self.policy
        if mode in ("off", "morph"):
            return None
        projected = self.projected_tokens = self.project(snap.demand_tokens)
        capacity = max(snap.capacity_tokens, 1)
        over = snap.demand_ratio > p.trigger or (snap.demand_ratio > p.trigger * p.predict_floor
                                                 and projected / capacity > p.trigger)
        self._over = self._over + 1 if over else 0
        low = snap.demand_tokens < p.restore_below * snap.base_capacity_tokens
        self._under = self._under + 1 if low else 0
        cooling = self._cooldown > 0   # this step is one of the cooldown's
        if cooling:
            self._cooldown -= 1
        if self.active in ("drop", "tp-merge"):
            if self._under >= max(p.restore_hold_steps, 1):
                return OverloadDecision("restore", f"demand {snap.demand_tokens} tokens < {p.restore_below:.0%} of "
                                                   f"the undropped {snap.base_capacity_tokens} for {self._under} steps")
            return None
        if self.active == "morph":
            if not snap.morphed and snap.demand_ratio <= p.trigger:
                return OverloadDecision("morph-done", "every layer is back at full precision")
            return None
        if self._over < max(p.hold_steps, 1) or cooling:
            return None
        deficit = max(projected, snap.demand_tokens) - snap.capacity_tokens
        why = f"demand {snap.demand_tokens} tokens ({projected} in {p.lead_steps} steps) > capacity " \
              f"{snap.capacity_tokens} for {self._over} steps"
        if mode == "auto":
            if self.has_morph and 0 < deficit <= snap.morph_headroom_tokens:
                return OverloadDecision("morph", f"{why}; morphing can add {snap.morph_headroom_tokens}", deficit)
            if not self.can_reshape:
                return OverloadDecision("morph", f"{why}; one worker: morphing is the only response", deficit) \
                    if self.has_morph else None
            return OverloadDecision("drop", why, deficit)
        return OverloadDecision(mode, why, deficit)

    def done(self, action: str, ok: bool) -> None:
        """The outcome of a decision: a response that went through is active; one that was refused (no plan, or a
        rolled-back transaction; the deployment serves on as before) is retried after RETRY_BACKOFF_STEPS."""
        self._over = 0
        self._under = 0
        if action in ("drop", "tp-merge", "morph"):
            if ok:
                self.active = action
            else:
                self._cooldown = RETRY_BACKOFF_STEPS
        elif action in ("restore", "morph-done") and ok:
            self.active = None
            self._cooldown = self.policy.cooldown_steps
