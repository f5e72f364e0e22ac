"""Helpers of the benchmarks: data paths, prompts cut from wikitext, machine description."""
from __future__ import annotations

import os
import platform
import random
import socket
import threading
import time
from pathlib import Path

import torch

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = Path(__file__).resolve().parent / "data"   # benchmark-only data (README.md there: source, licence)
RESULTS_DIR = PROJECT_ROOT / "out" / "benchmarks"   # plots and result files (git-ignored), never the repo root


def result_path(name: str) -> Path:
    """Where a benchmark writes its output file `name` by default: out/benchmarks/ of the checkout."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / name


def wikitext_text() -> str:
    """The WikiText-2 validation text shipped with the package (elastic_hf/data/NOTICE.md)."""
    from elastic_hf.paths import default_calibration_text

    return default_calibration_text().read_text()


def wikitext_prompts(tokenizer, num_prompts: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of random length in [min_tokens, max_tokens], cut at random offsets of wikitext."""
    text = wikitext_text()
    ids = tokenizer.encode(text[:400_000], add_special_tokens=False)
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        length = rng.randint(min_tokens, max_tokens)
        start = rng.randint(0, len(ids) - length - 1)
        prompts.append(ids[start:start + length])
    return prompts


class CallTimer:
    """Wraps the callables `owner.name` for each (owner, name) given (methods of an object, functions of a module)
    and sums the seconds spent in them since the last take()."""

    def __init__(self, *targets):
        self.spent = 0.0
        for owner, name in targets:
            if hasattr(owner, name):
                setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - start
        return run

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def machine_description() -> str:
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads)")


def add_reshape_workload_args(parser, *, max_new_tokens: int) -> None:
    """The mid-decode workload flags the reshape benchmarks share."""
    parser.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=192)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--kv-mib", type=int, default=192, help="KV MiB per worker as a TP1 instance")


def running_state(dep) -> list[list[int]]:
    """Token ids (prompt + generated) of every unfinished sequence of a deployment."""
    return [list(s.token_ids) for inst in dep.instances for r in inst.engine.requests.values() for s in r.seqs]


def restart_and_reprefill(model_path, state: list[list[int]], **options) -> tuple[float, int]:
    """The restart-based reconfiguration a reshape replaces: start a 2-worker deployment with `options` (new
    processes, checkpoint reload, groups) and re-prefill every running sequence (prompt + generated tokens) to the
    same state. Returns (seconds, prompt tokens computed)."""
    from elastic_hf import ElasticModel
    from elastic_hf.engine.sampling_params import SamplingParams

    started = time.perf_counter()
    model = ElasticModel.from_pretrained(model_path, workers=2, **options)
    try:
        dep = model.deployment
        resume = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        pending = {dep.add_request(None, tokens, resume) for tokens in state}
        while pending:
            for out in dep.step():
                if out.finished:
                    pending.discard(out.request_id)
        return time.perf_counter() - started, dep.stats()["num_computed_prompt_tokens"]
    finally:
        model.close()


class InProcessServer:
    """One ElasticModel behind the OpenAI app and the admin morph routes (key "bench"), served by uvicorn in a
    thread of this process, so a benchmark can read the deployment between requests. `build` makes the model on
    the engine thread, as `elastic-hf serve` does (one thread owns the model's OpenMP work: engine/async_engine.py);
    it is `self.model` afterwards."""

    def __init__(self, build):
        import uvicorn

        from elastic_hf.engine.async_engine import AsyncEngine
        from elastic_hf.serving.admin_morph import admin_morph_router
        from elastic_hf.serving.app import build_app

        self.async_engine = AsyncEngine()
        self.model = model = self.async_engine.start(build=build)
        if model.morph is not None:   # swaps then run at the engine thread's step boundaries (as `serve` does)
            model.morph.attach_driver(self.async_engine.wake)
        app = build_app(self.async_engine, model_id=model.model_id)
        app.include_router(admin_morph_router(model, self.async_engine, "bench"))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.async_engine.shutdown()
        self.sock.close()
