"""A hung worker (SIGSTOP: stopped, as a deadlock or a stuck device would leave it) used to freeze the deployment:
step RPCs waited forever. Now a step has a deadline (step_timeout_s + 50 ms a token): the workers that did not
answer are ended and replaced, and the requests of their instance are recomputed and finish with HF's tokens."""
import os
import signal
import time

from elastic_hf import ElasticModel
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.model.loader import load_hf_model
from deployment_steps import run_steps
from greedy_reference import hf_greedy, mixed_prompts


def test_a_stopped_worker_is_replaced_and_its_requests_finish_exactly(tp_checkpoint):
    path = tp_checkpoint("kv3")
    reference, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 3, 5, 40, seed=51)
    expected = [hf_greedy(reference, p, 16) for p in prompts]
    with ElasticModel.from_pretrained(path, workers=2, tp=2, kv_cache_memory=1 << 20, step_timeout_s=3.0,
                                      enable_prefix_caching=False) as model:
        dep = model.deployment
        ids = [dep.add_request(None, p, SamplingParams(temperature=0.0, max_tokens=16)) for p in prompts]
        done = run_steps(dep, ids, {}, num_steps=4)
        stopped = dep.pool.pids()[1]
        os.kill(stopped, signal.SIGSTOP)
        started = time.monotonic()
        try:
            run_steps(dep, ids, done)
        finally:
            try:
                os.kill(stopped, signal.SIGKILL)   # already ended by the deployment; never leave it stopped
            except ProcessLookupError:
                pass
        assert time.monotonic() - started < 60
        assert dep.num_recoveries >= 1 and stopped not in dep.pool.pids()
        assert [done[r] for r in ids] == expected
