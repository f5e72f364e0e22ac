"""A per-request and per-step timeline of one engine, as JSON lines (`elastic-hf serve --timeline PATH`).

Where a request's time to first token goes under load is the question the Prometheus histograms cannot answer:
they aggregate. This log keeps every event, so a tail request can be followed from arrival (the HTTP request was
received) through admission (its first chunk was scheduled), its chunks, its first token, to its finish, beside
the steps that ran meanwhile (how many prefill tokens and decodes each packed, how long it took, how long the queue
was). `benchmarks/serving_timeline.py` joins it with a client's view (HTTP in and out) and explains the tail.

Records (one JSON object per line, times in seconds since the epoch, `time.time()`):
- {"kind": "step", "start", "end", "prefill_tokens", "prefill_seqs", "decode_seqs", "admitted", "waiting",
   "running", "kv_used", "kv_total", "preemptions"}: one engine step (its schedule, run and output processing);
- {"kind": "request", "id", "arrival", "scheduled", "first_token", "finish", "prompt_tokens", "cached_tokens",
   "output_tokens", "preemptions", "finish_reason", "chunks"}: a request that left the engine (`scheduled` is its
   first admission; `chunks` counts the steps that computed prompt tokens of it).

A pipelined instance that keeps several batches in flight (engine/batch_queue.py) records its requests but not its
steps, which overlap. The step records of a deployment with several instances interleave (they carry each
engine's own queue and KV numbers, not the deployment's). A write that fails (a full disk) stops the records,
never the requests. Written by the engine threads, line-buffered, so a reader may follow it while the server
runs."""
from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from pathlib import Path

from elastic_hf.engine.sequence import Request
from elastic_hf.engine.step_plan import SchedulerOutput

log = logging.getLogger(__name__)


class Timeline:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")
        weakref.finalize(self, self._file.close)   # closed with its deployment (lines are flushed as written)
        self._lock = threading.Lock()   # a deployment's instance engines may share one timeline
        self._chunks: dict[str, int] = {}   # request id -> steps that computed prompt tokens of it so far
        self._failed = False

    def step_mix(self, scheduled: SchedulerOutput) -> tuple[int, int, int]:
        """(prefill tokens, prefill sequences, decodes) of a step, taken before it runs. A chunk is prefill unless
        it is the one last token of its sequence (a decode); a recompute after preemption counts as prefill."""
        prefill_tokens = prefill_seqs = decode_seqs = 0
        for s in scheduled:
            seq = s.seq
            if s.num_new_tokens == 1 and s.start == len(seq.token_ids) - 1 and s.start >= seq.num_prompt_tokens:
                decode_seqs += 1
                continue
            prefill_tokens += s.num_new_tokens
            prefill_seqs += 1
            if seq.index == 0:
                self._chunks[seq.request_id] = self._chunks.get(seq.request_id, 0) + 1
        return prefill_tokens, prefill_seqs, decode_seqs

    def on_step(self, start: float, end: float, mix: tuple[int, int, int], *, admitted: int, waiting: int,
                running: int, kv_used: int, kv_total: int, preemptions: int) -> None:
        prefill_tokens, prefill_seqs, decode_seqs = mix
        self._write({"kind": "step", "start": round(start, 6), "end": round(end, 6), "prefill_tokens": prefill_tokens,
                     "prefill_seqs": prefill_seqs, "decode_seqs": decode_seqs, "admitted": admitted,
                     "waiting": waiting, "running": running, "kv_used": kv_used, "kv_total": kv_total,
                     "preemptions": preemptions})

    def on_request_finished(self, request: Request) -> None:
        finish_time = request.finish_time if request.finish_time is not None else time.time()
        starts = [s.scheduled_time for s in request.seqs if s.scheduled_time is not None]
        self._write({"kind": "request", "id": request.request_id, "arrival": round(request.arrival_time, 6),
                     "scheduled": round(min(starts), 6) if starts else None,
                     "first_token": None if request.first_token_time is None else round(request.first_token_time, 6),
                     "finish": round(finish_time, 6), "prompt_tokens": len(request.prompt_token_ids),
                     "cached_tokens": max((s.num_cached_tokens for s in request.seqs), default=0),
                     "output_tokens": sum(s.num_output_tokens for s in request.seqs),
                     "preemptions": sum(s.num_preemptions for s in request.seqs),
                     "finish_reason": request.error and "error" or request.seqs[0].finish_reason,
                     "chunks": self._chunks.pop(request.request_id, 0)})

    def _write(self, record: dict) -> None:
        """A line, or nothing once writing failed (a full disk must not fail the requests it records)."""
        if self._failed:
            return
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            try:
                self._file.write(line)
            except (OSError, ValueError) as exc:   # ValueError: the file was closed
                self._failed = True
                log.error("timeline %s: writing failed (%s); no more records are written", self.path, exc)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_timeline(path: str | Path) -> tuple[list[dict], dict[str, dict]]:
    """(step records in order, request records by id) of a timeline file."""
    steps, requests = [], {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if record["kind"] == "step":
                steps.append(record)
            else:
                requests[record["id"]] = record
    return steps, requests
