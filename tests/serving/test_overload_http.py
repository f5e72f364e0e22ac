"""`elastic-hf serve --workers 2 --overload {drop,auto,tp-merge}`: a burst of streamed completions through the real
`openai` client overloads the KV cache, the arbiter acts on its own (a parameter drop, auto's choice of one, or a
TP merge), every answer equals the unloaded server's, /metrics shows the decision and the gauges (demand ratio,
requests waiting on the KV exchange, the cost model's error under lookahead), and once the load is gone the layout
comes back to [1,1]."""
import concurrent.futures
import json
import os
import threading
import time

import httpx
import openai
import pytest

from test_cli import start_cli_server, stop_cli_server

ADMIN = {"Authorization": "Bearer admin-secret"}
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "The history of the Roman Empire",
           "A list of prime numbers:"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def drop_checkpoint(tmp_path_factory):
    from tiny_models import build_tiny_checkpoint

    # 5 layers with a wide MLP (1.6 MiB a layer fp32), as tests/parallel/test_param_drop.py: dropping a layer or
    # halving it (TP2) frees KV blocks worth having (the tiny serving model's weights are nearly all embeddings)
    return str(build_tiny_checkpoint("llama", tmp_path_factory.mktemp("overload") / "llama", 0, num_hidden_layers=5,
                                     intermediate_size=2048))


def _stream(base: str, prompt: str, start: threading.Barrier | None = None) -> str:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    if start is not None:   # every client is set up: the requests leave together and overlap on any machine
        start.wait(timeout=120)
    chunks = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _metric(text: str, name: str) -> list[float]:
    return [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)]


@pytest.mark.parametrize("mode,event,layout", [("drop", "drop", "[1x2"), ("auto", "drop", "[1x2"),
                                               ("tp-merge", "tp-merge", "[2]")])
def test_overload_response_acts_on_a_burst_and_restores(drop_checkpoint, tmp_path, mode, event, layout):
    from transformers import AutoConfig

    from elastic_hf.engine.cost_model import CostModel

    layers = AutoConfig.from_pretrained(drop_checkpoint).num_hidden_layers
    profile = tmp_path / "cost.json"   # any fitted-looking profile: lookahead and its error gauge need one
    CostModel(alpha=1e-7, beta=2e-5, gamma=2e-4, lam=1e-4, head=5e-5, num_layers=layers, min_tokens=4).save(profile)
    env = {**os.environ, "ELASTIC_HF_ADMIN_KEY": "admin-secret"}
    proc, base = start_cli_server([drop_checkpoint, "--workers", "2", "--kv-cache-memory", "512KiB",
                                   "--max-model-len", "256", "--overload", mode, "--cost-profile", str(profile),
                                   "--log-level", "warning"], env)
    try:
        before = [_stream(base, p) for p in PROMPTS]   # one at a time: no overload
        state = httpx.get(base + "/admin/drop", headers=ADMIN, timeout=30).json()
        assert state["mode"] == mode and state["topology"] == "[1,1]" and not state["history"]
        # Enough concurrent requests that their KV (prompt + 40 tokens each) is twice the attached capacity.
        burst = 2 * state["capacity_tokens"] // (MAX_TOKENS + 8) + 2
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(burst)]
        # A loaded CI machine sets up the clients one by one over seconds, while each request lasts a few hundred
        # ms: without the barrier the burst can arrive as a trickle that never overloads anything.
        start = threading.Barrier(burst)
        with concurrent.futures.ThreadPoolExecutor(burst) as pool:
            answers = list(pool.map(lambda p: _stream(base, p, start), prompts))
        assert answers == [before[i % len(PROMPTS)] for i in range(burst)]
        state = httpx.get(base + "/admin/drop", headers=ADMIN, timeout=30).json()
        acted = [h for h in state["history"] if h["event"] == event and h["outcome"] == "committed"]
        assert acted and acted[0]["new"].startswith(layout), json.dumps(state["history"])
        metrics = httpx.get(base + "/metrics", timeout=30).text
        assert _metric(metrics, f'elastic_hf_overload_decisions_total{{action="{event}",outcome="done"}}') == [1.0]
        assert _metric(metrics, "elastic_hf_kv_demand_ratio")
        assert _metric(metrics, "elastic_hf_requests_exchanging") == [0.0]   # every exchange has finished
        if event == "drop":
            assert _metric(metrics, 'elastic_hf_param_drops_total{outcome="committed"}') == [1.0]
            assert any(h["event"] == "exchange_done" for h in state["history"])
            error = _metric(metrics, "elastic_hf_cost_model_error")
            assert error and error[0] > 0   # lookahead ran on the pipeline group and was scored
        deadline = time.monotonic() + 120   # idle: the arbiter restores after its hold (the server keeps stepping)
        while state["topology"] != "[1,1]" and time.monotonic() < deadline:
            time.sleep(0.5)
            state = httpx.get(base + "/admin/drop", headers=ADMIN, timeout=30).json()
        assert state["topology"] == "[1,1]" and state["history"][-1]["event"] == "restore", state["history"]
        assert [_stream(base, p) for p in PROMPTS] == before
    finally:
        stop_cli_server(proc)
