"""benchmarks/replay.py is reused by later benchmarks: its trace scaling, prompt building and SSE client must
work against a real server (a smoke run of a few requests; no timing is asserted)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import replay  # noqa: E402


def test_scale_trace_applies_factors_and_caps():
    rows = replay.load_trace(num_requests=10)
    assert rows[0].arrival_s == 0 and all(b.arrival_s >= a.arrival_s for a, b in zip(rows, rows[1:]))
    scale = replay.TraceScale(time_scale=2.0, prompt_scale=0.5, output_scale=1.0, max_prompt_tokens=100,
                              max_output_tokens=8)
    scaled = replay.scale_trace(rows, scale)
    for raw, new in zip(rows, scaled):
        assert new.arrival_s == raw.arrival_s * 2.0
        assert new.prompt_tokens == min(100, max(1, round(raw.prompt_tokens * 0.5)))
        assert 1 <= new.output_tokens <= 8
    rate = 0.25
    factor = replay.time_scale_for_rate(rows, rate)
    stretched = replay.scale_trace(rows, replay.TraceScale(factor, 1, 1, 10**6, 10**6))
    assert abs((len(rows) - 1) / stretched[-1].arrival_s - rate) < 1e-9


def test_conversation_trace_is_a_different_workload_from_the_code_trace():
    """The second trace ships in benchmarks/data and is found by name; over the window the serving benchmarks
    replay (48 rows) it is decode-heavy where the code trace is prefill-heavy."""
    code, conv = replay.load_trace("code", num_requests=48), replay.load_trace("conv", num_requests=48)
    assert (conv[0].prompt_tokens, conv[0].output_tokens) == (374, 44)   # the file's first row
    assert replay.load_trace(None, num_requests=48) == code
    mean = lambda rows, key: sum(getattr(r, key) for r in rows) / len(rows)   # noqa: E731
    assert mean(code, "prompt_tokens") / mean(code, "output_tokens") > 50
    assert mean(conv, "prompt_tokens") / mean(conv, "output_tokens") < 10
    assert replay.prompt_scale_for("conv") == 0.25 and replay.prompt_scale_for(None) == 1 / 16
    assert replay.prompt_scale_for("conv", 0.5) == 0.5   # a --prompt-scale flag wins over the trace's default


def test_replay_against_server(tiny_server):
    rows = replay.scale_trace(replay.load_trace(num_requests=6),
                              replay.TraceScale(0.0, 1 / 64, 1.0, 64, 6))  # time x0: all arrive at once
    requests = replay.build_requests(rows, tiny_server.model.tokenizer)
    assert [len(r.prompt) for r in requests] == [r.prompt_tokens for r in rows]
    report = replay.run_replay(tiny_server.base_url, requests, api_key=tiny_server.api_key, progress=False,
                               ttft_slo_s=1e9, tpot_slo_s=1e9)
    assert len(report.ok) == 6, [r.error for r in report.results]
    assert [r.output_tokens for r in report.results] == [r.max_tokens for r in requests]
    assert report.slo_attainment == 1.0
    lines = report.result_lines()
    assert all(line.startswith("RESULT replay_") for line in lines)
    assert "RESULT replay_failed_requests 0" in lines
