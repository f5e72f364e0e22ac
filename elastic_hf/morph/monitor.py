"""Serving monitor (MorphServe §4.1): per-step samples of KV use, queue length and delay, TTFT and TPOT, smoothed
over a short window of steps. Torch-free; the morph manager feeds it from the engine at every step boundary."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class ServingSample:
    time: float                  # seconds, any monotonic clock
    kv_blocks_used: int
    kv_blocks_total: int
    num_waiting: int
    num_running: int
    queue_delay_s: float = 0.0   # how long the oldest waiting request has waited
    blocked_on_kv: bool = False  # the head of the queue cannot get its KV blocks (morphing can help)
    ttft_s: list[float] = field(default_factory=list)   # first tokens since the previous sample
    tpot_s: list[float] = field(default_factory=list)   # inter-token gaps since the previous sample

    def __post_init__(self):
        if self.kv_blocks_total < 0 or not 0 <= self.kv_blocks_used <= max(self.kv_blocks_total, 0):
            raise ValueError(f"kv_blocks_used={self.kv_blocks_used} must be in [0, kv_blocks_total="
                             f"{self.kv_blocks_total}]")
        if self.num_waiting < 0 or self.num_running < 0:
            raise ValueError(f"queue lengths must be >= 0, got waiting={self.num_waiting}, "
                             f"running={self.num_running}")

    @property
    def kv_use(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 1.0


@dataclass(slots=True)
class MonitorView:
    """Smoothed view over the last `window` samples (means), plus the latest raw sample."""
    kv_use: float
    queue_delay_s: float
    queue_len: float
    blocked_on_kv: bool      # in the majority of the window
    ttft_s: float | None     # mean over the window's first tokens, None if there were none
    tpot_s: float | None
    latest: ServingSample


class ServingMonitor:
    def __init__(self, window: int = 4):
        if window < 1:
            raise ValueError(f"window={window} must be >= 1 step")
        self.window = window
        self._samples: deque[ServingSample] = deque(maxlen=window)

    def observe(self, sample: ServingSample) -> MonitorView:
        self._samples.append(sample)
        s = self._samples
        n = len(s)
        ttfts = [t for x in s for t in x.ttft_s]
        tpots = [t for x in s for t in x.tpot_s]
        return MonitorView(
            kv_use=sum(x.kv_use for x in s) / n,
            queue_delay_s=sum(x.queue_delay_s for x in s) / n,
            queue_len=sum(x.num_waiting for x in s) / n,
            blocked_on_kv=2 * sum(x.blocked_on_kv for x in s) > n,
            ttft_s=sum(ttfts) / len(ttfts) if ttfts else None,
            tpot_s=sum(tpots) / len(tpots) if tpots else None,
            latest=sample)

    def reset(self) -> None:
        self._samples.clear()
