"""Morphing controller (MorphServe §4.1, §4.4, §6 "stability under oscillating load"): threshold triggers with
persistence windows and hysteresis. Torch-free: it sees ServingSamples and the layers' precisions and returns
decisions; the morph manager executes them.

- Morph: when the smoothed KV use exceeds `kv_use_threshold`, or the smoothed queue delay exceeds
  `queue_delay_threshold_s` while the queue waits for KV blocks, for `persistence_steps` consecutive steps,
  move the next `layers_per_step` layers of the swap order (LIS, or front-to-back) to `precision`.
  Queue delay alone does not count: on a slow CPU a queue also forms when the step's token budget is full, and
  quantizing weights cannot help that.
- Restore: when nothing waits, and the KV use projected onto the smaller cache after giving back the next
  layer's blocks stays below `restore_kv_use`, for `restore_persistence_steps` steps and `restore_hold_s`
  seconds, restore the most recently morphed layers (reverse swap order) to full precision.
The gap between kv_use_threshold and restore_kv_use plus both persistence windows is the hysteresis: a load
hovering at the threshold causes at most one morph and no restore while it stays there."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from elastic_hf.config import CONTROLLER_MODES, MODE_PRECISION
from elastic_hf.morph.monitor import MonitorView, ServingMonitor, ServingSample

PRECISION_RANK = {"fp": 0, "w8": 1, "w4": 2}   # higher = fewer bytes


@dataclass(slots=True)
class ControllerConfig:
    kv_use_threshold: float = 0.85
    queue_delay_threshold_s: float = 0.1
    persistence_steps: int = 4
    window_steps: int = 4
    layers_per_step: int = 2
    precision: str = "w4"              # what morphed layers become (the mode's lowest precision)
    max_layers: int | None = None      # cap on layers below full precision; None = all
    restore_kv_use: float = 0.6
    restore_persistence_steps: int = 16
    restore_hold_s: float = 2.0
    restore_layers_per_step: int = 1

    def __post_init__(self):
        if not 0.0 < self.kv_use_threshold <= 1.0:
            raise ValueError(f"kv_use_threshold={self.kv_use_threshold} must be in (0, 1]")
        if not 0.0 <= self.restore_kv_use < self.kv_use_threshold:
            raise ValueError(f"restore_kv_use={self.restore_kv_use} must be in [0, kv_use_threshold="
                             f"{self.kv_use_threshold}): the gap is the hysteresis")
        if self.queue_delay_threshold_s <= 0:
            raise ValueError(f"queue_delay_threshold_s={self.queue_delay_threshold_s} must be > 0")
        for name in ("persistence_steps", "window_steps", "layers_per_step", "restore_persistence_steps",
                     "restore_layers_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.precision not in ("w8", "w4"):
            raise ValueError(f"precision={self.precision!r} must be 'w8' or 'w4'")
        if self.max_layers is not None and self.max_layers < 0:
            raise ValueError(f"max_layers={self.max_layers} must be >= 0 or None")
        if self.restore_hold_s < 0:
            raise ValueError(f"restore_hold_s={self.restore_hold_s} must be >= 0")

    @classmethod
    def for_mode(cls, mode: str, **overrides) -> "ControllerConfig":
        if mode not in CONTROLLER_MODES:
            raise ValueError(f"morph mode {mode!r} is unknown; allowed: {', '.join(CONTROLLER_MODES)}")
        presets = {
            # accuracy: act late, one layer at a time, never below INT8
            "accuracy": dict(kv_use_threshold=0.95, queue_delay_threshold_s=0.25, persistence_steps=8,
                             layers_per_step=1, precision=MODE_PRECISION["accuracy"], restore_kv_use=0.7),
            # default: MorphServe's thresholds (KV > 85 %, queue delay > 100 ms)
            "default": dict(),
            # performance: act early and in bigger steps, INT4
            "performance": dict(kv_use_threshold=0.75, queue_delay_threshold_s=0.05, persistence_steps=2,
                                layers_per_step=4, restore_kv_use=0.5, restore_persistence_steps=32),
        }
        return replace(cls(), **{**presets[mode], **overrides})


@dataclass(slots=True)
class MorphDecision:
    kind: str            # "morph" | "restore"
    layers: list[int]
    precision: str       # the target precision of those layers
    reason: str


class MorphController:
    def __init__(self, config: ControllerConfig, order: Sequence[int], blocks_per_layer: dict[str, int]):
        """order: swap order of the layers (LIS, least important first). blocks_per_layer: KV blocks one layer
        gives to the cache when it goes from fp to that precision."""
        if sorted(order) != list(range(len(order))):
            raise ValueError(f"order must be a permutation of 0..{len(order) - 1}, got {list(order)}")
        self.config = config
        self.order = list(order)
        self.blocks_per_layer = dict(blocks_per_layer)
        self.monitor = ServingMonitor(config.window_steps)
        self.enabled = True
        self._high_steps = 0
        self._low_steps = 0
        self._low_since: float | None = None
        self.last_view: MonitorView | None = None

    def _pressure(self, view: MonitorView) -> str | None:
        c = self.config
        if view.kv_use > c.kv_use_threshold:
            return f"KV use {view.kv_use:.0%} > {c.kv_use_threshold:.0%}"
        if view.queue_delay_s > c.queue_delay_threshold_s and view.blocked_on_kv:
            return (f"queue delay {view.queue_delay_s * 1e3:.0f} ms > {c.queue_delay_threshold_s * 1e3:.0f} ms "
                    f"waiting for KV blocks")
        return None

    def _morph_candidates(self, precisions: Sequence[str]) -> list[int]:
        c = self.config
        rank = PRECISION_RANK[c.precision]
        num_reduced = sum(p != "fp" for p in precisions)
        out = []
        for layer in self.order:
            if len(out) >= c.layers_per_step:
                break
            if PRECISION_RANK[precisions[layer]] >= rank:
                continue
            if precisions[layer] == "fp":
                if c.max_layers is not None and num_reduced >= c.max_layers:
                    continue
                num_reduced += 1
            out.append(layer)
        return out

    def _restore_candidates(self, precisions: Sequence[str]) -> list[int]:
        reduced = [layer for layer in reversed(self.order) if precisions[layer] != "fp"]
        return reduced[: self.config.restore_layers_per_step]

    def _projected_use(self, sample: ServingSample, layers: list[int], precisions: Sequence[str]) -> float:
        lost = sum(self.blocks_per_layer.get(precisions[j], 0) for j in layers)
        remaining = sample.kv_blocks_total - lost
        return 1.0 if remaining <= 0 else sample.kv_blocks_used / remaining

    def decide(self, sample: ServingSample, precisions: Sequence[str], busy: bool) -> MorphDecision | None:
        """One call per step boundary. precisions: each layer's (target) precision; busy: swaps still running
        (the windows restart after a morph, so its effect is seen before the next one)."""
        view = self.monitor.observe(sample)
        self.last_view = view
        if busy or not self.enabled:
            self._high_steps = self._low_steps = 0
            self._low_since = None
            return None
        c = self.config
        reason = self._pressure(view)
        if reason is not None:
            self._high_steps += 1
            self._low_steps, self._low_since = 0, None
            if self._high_steps >= c.persistence_steps:
                layers = self._morph_candidates(precisions)
                if layers:
                    self._high_steps = 0
                    self.monitor.reset()
                    return MorphDecision("morph", layers, c.precision,
                                         f"{reason} for {c.persistence_steps} steps")
            return None
        self._high_steps = 0
        layers = self._restore_candidates(precisions)
        calm = (sample.num_waiting == 0 and layers
                and self._projected_use(sample, layers, precisions) < c.restore_kv_use)
        if not calm:
            self._low_steps, self._low_since = 0, None
            return None
        self._low_steps += 1
        if self._low_since is None:
            self._low_since = sample.time
        if self._low_steps >= c.restore_persistence_steps and sample.time - self._low_since >= c.restore_hold_s:
            self._low_steps, self._low_since = 0, None
            self.monitor.reset()
            return MorphDecision("restore", layers, "fp",
                                 f"KV use would stay below {c.restore_kv_use:.0%} with no queue for "
                                 f"{c.restore_persistence_steps} steps")
        return None
