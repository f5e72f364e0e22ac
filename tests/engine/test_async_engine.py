"""AsyncEngine over a scripted fake engine: errors reach the right caller, a failed step does not stop the loop,
an abandoned stream is aborted, and an idle engine thread sleeps instead of polling."""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from elastic_hf.engine.async_engine import AsyncEngine
from elastic_hf.engine.errors import EngineError
from elastic_hf.engine.input_processor import EngineRequest, InputProcessor
from elastic_hf.engine.metrics import EngineMetrics
from elastic_hf.engine.outputs import CompletionOutput, RequestOutput
from elastic_hf.engine.sampling_params import SamplingParams


class CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


class FakeEngine:
    """One token per step per request; `fail_steps` makes the next steps raise."""
    model_id, max_model_len, tokenizer = "fake", 100, CharTokenizer()

    def __init__(self):
        self.metrics = EngineMetrics("fake")
        # the fake runs any length: its input processor checks emptiness and token ranges
        self.input_processor = InputProcessor(self.tokenizer, vocab_size=1 << 16, max_model_len=1 << 30)
        self.requests: dict[str, list] = {}
        self.aborted: list[str] = []
        self.fail_steps = 0
        self.num_steps = 0
        self.num_polls = 0

    def add_request(self, request_id, prompt, params=None, arrival_time=None):
        assert isinstance(prompt, EngineRequest) and prompt.prompt_token_ids   # processed on the input thread
        self.requests[request_id] = [prompt.params.max_tokens, []]

    def abort_request(self, request_id):
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        self.num_polls += 1
        return bool(self.requests)

    def step(self):
        self.num_steps += 1
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("simulated kernel failure")
        outputs = []
        for request_id, (max_tokens, tokens) in list(self.requests.items()):
            tokens.append(len(tokens))
            done = len(tokens) >= max_tokens
            outputs.append(RequestOutput(request_id, [1], [CompletionOutput(
                0, text="t" * len(tokens), token_ids=list(tokens), delta_text="t", delta_token_ids=[tokens[-1]],
                finish_reason="length" if done else None)], done))
            if done:
                del self.requests[request_id]
        return outputs

    def stats(self):
        return {"kv_blocks_used": len(self.requests), "kv_blocks_total": 10, "num_requests": len(self.requests)}


@pytest.fixture
def engine():
    fake = FakeEngine()
    async_engine = AsyncEngine(fake).start()
    yield async_engine, fake
    async_engine.shutdown()


async def _collect(async_engine, prompt, max_tokens):
    return [out async for out in async_engine.generate(prompt, SamplingParams(max_tokens=max_tokens))]


def test_outputs_arrive_in_order_and_finish(engine):
    async_engine, _ = engine
    outs = asyncio.run(_collect(async_engine, "hi", 5))
    assert [o.outputs[0].token_ids[-1] for o in outs] == [0, 1, 2, 3, 4]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"


def test_value_error_surfaces_at_first_iteration(engine):
    async_engine, _ = engine
    with pytest.raises(ValueError, match="prompt is empty"):
        asyncio.run(_collect(async_engine, "", 5))


def test_failed_step_fails_in_flight_requests_and_keeps_serving(engine):
    async_engine, fake = engine
    fake.fail_steps = 1
    with pytest.raises(EngineError, match="simulated kernel failure"):
        asyncio.run(_collect(async_engine, "hi", 50))
    assert fake.requests == {}, "the failed request still holds engine state"
    outs = asyncio.run(_collect(async_engine, "again", 3))
    assert outs[-1].finished
    assert async_engine.stats()["num_step_errors"] == 1


def test_abandoned_stream_is_aborted(engine):
    async_engine, fake = engine

    async def consume_two():
        async with contextlib.aclosing(async_engine.generate("hi", SamplingParams(max_tokens=10**6))) as stream:
            async for out in stream:
                if len(out.outputs[0].token_ids) >= 2:
                    return out.request_id

    request_id = asyncio.run(consume_two())
    deadline = time.monotonic() + 10
    while request_id not in fake.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert request_id in fake.aborted


def test_cancelled_consumer_aborts(engine):
    async_engine, fake = engine

    async def cancel_midway():
        task = asyncio.ensure_future(_collect(async_engine, "hi", 10**6))
        while not fake.requests:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    deadline = time.monotonic() + 10
    while not fake.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(fake.aborted) == 1 and fake.requests == {}


def test_idle_engine_thread_sleeps(engine):
    async_engine, fake = engine
    asyncio.run(_collect(async_engine, "hi", 3))
    steps, polls = fake.num_steps, fake.num_polls
    time.sleep(0.3)
    # A spinning loop would poll thousands of times in 0.3 s; a sleeping one not at all.
    assert fake.num_steps == steps
    assert fake.num_polls - polls <= 2


def test_shutdown_fails_pending_requests(engine):
    async_engine, _ = engine

    async def run():
        stream = await async_engine.add_request("hi", SamplingParams(max_tokens=10**6))
        async_engine.shutdown()
        with pytest.raises(EngineError):
            async for _ in stream:
                pass

    asyncio.run(run())


def test_call_runs_on_engine_thread_between_steps(engine):
    import threading

    async_engine, fake = engine

    async def run():
        name = await async_engine.call(lambda: threading.current_thread().name)
        with pytest.raises(KeyError):
            await async_engine.call(lambda: {}["missing"])
        return name

    assert asyncio.run(run()) == "elastic-hf-engine"
    assert asyncio.run(_collect(async_engine, "still serving", 2))[-1].finished


def test_wake_rechecks_engine_work(engine):
    async_engine, fake = engine
    # Work that appears inside the engine without a command (as the morph manager does) runs after wake().
    fake.requests["internal"] = [3, []]
    async_engine.wake()
    deadline = time.monotonic() + 10
    while fake.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not fake.requests


class _Built:
    """What `start(build=...)` expects back: an object with the engine under `.engine` (as ElasticModel)."""

    def __init__(self, engine, built_on: str):
        self.engine = engine
        self.built_on = built_on


def test_build_runs_on_the_engine_thread_that_steps():
    """The model is built on the thread that steps it, so one thread owns all of the data plane's OpenMP work."""
    import threading

    step_threads: set[str] = set()

    class RecordingEngine(FakeEngine):
        def step(self):
            step_threads.add(threading.current_thread().name)
            return super().step()

    async_engine = AsyncEngine(name="engine-owner")
    built = async_engine.start(build=lambda: _Built(RecordingEngine(), threading.current_thread().name))
    try:
        assert built.built_on == "engine-owner"
        assert async_engine.engine is built.engine
        outs = asyncio.run(_collect(async_engine, "hi", 3))
        assert outs[-1].finished
        assert step_threads == {"engine-owner"}
        assert async_engine.stats()["num_step_errors"] == 0
    finally:
        async_engine.shutdown()


def test_failed_build_raises_in_the_caller_and_leaves_no_thread():
    import threading

    def build():
        raise OSError("no checkpoint at /nowhere")

    async_engine = AsyncEngine(name="doomed-engine")
    with pytest.raises(OSError, match="/nowhere"):
        async_engine.start(build=build)
    assert not async_engine.is_running
    assert "doomed-engine" not in {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="no engine"):
        async_engine.start()
