"""A flood of over-long prompts does not stall the streams in flight: their tokenization and the length check run
on the input thread (engine/input_processor.py via AsyncEngine), off the event loop and off the engine thread, so
a running stream's inter-token gaps stay within 2x of their undisturbed value while 20 prompts of ~900 KB each
are tokenized and refused with 400."""
from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import pytest

from serving_helpers import PROMPTS, tiny_model_server

FLOOD = 20
FLOOD_PROMPT = "hello world " * 75_000   # ~900 KB, ~150k tokens: seconds of tokenizer work per request


@pytest.fixture(scope="module")
def big_body_server(serving_checkpoint):
    with tiny_model_server(serving_checkpoint, max_body_bytes=1 << 20) as handle:
        yield handle


@pytest.mark.serial   # its bound compares stream gaps during the flood with those before it
def test_stream_gaps_hold_while_over_long_prompts_are_rejected(big_body_server):
    server = big_body_server
    arrivals: list[float] = []
    flood_window: dict[str, float] = {}
    statuses: list[int] = []
    flood_started = threading.Event()

    def flood():
        def one():
            response = httpx.post(server.base_url + "/v1/completions", timeout=120, json={
                "model": server.model_id, "prompt": FLOOD_PROMPT, "max_tokens": 4})
            statuses.append(response.status_code)
        threads = [threading.Thread(target=one) for _ in range(FLOOD)]
        flood_window["start"] = time.monotonic()
        flood_started.set()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        flood_window["end"] = time.monotonic()

    body = {"model": server.model_id, "prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    flooder = threading.Thread(target=flood)
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"]:
                arrivals.append(time.monotonic())
            if len(arrivals) == 100:
                flooder.start()
            if flood_window.get("end") is not None:
                break
    flooder.join(120)
    assert statuses == [400] * FLOOD, statuses
    gaps = [(b - a, b) for a, b in zip(arrivals, arrivals[1:])]
    before = [g for g, t in gaps if t < flood_window["start"]][20:]   # past the stream's warm-up
    during = [g for g, t in gaps if flood_window["start"] <= t <= flood_window["end"]]
    assert len(before) >= 50 and len(during) >= 20, (len(before), len(during))
    print(f"median gap before {statistics.median(before) * 1e3:.2f} ms, during the flood "
          f"{statistics.median(during) * 1e3:.2f} ms ({len(during)} gaps)")
    assert statistics.median(during) <= 2 * statistics.median(before) + 0.002, \
        (statistics.median(before), statistics.median(during))
