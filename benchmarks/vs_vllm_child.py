"""One timed offline run of one engine, in its own process (run by benchmarks/vs_vllm.py with the interpreter of
that engine's virtual environment: ours for elastic-hf, .venv-vllm's for vLLM). Reads a JSON job on stdin, loads
the engine, warms it up, times one `generate` over all prompts, prints one line `JOB_RESULT {...}`.

Job: {"engine": "elastic" | "vllm", "checkpoint": DIR, "dtype": "float32" | "bfloat16", "prompts": [[ids]],
      "max_tokens": N, "max_num_batched_tokens": N, "max_model_len": N (vLLM's; default 2048)}"""
from __future__ import annotations

import json
import sys
import time


def run_elastic(job: dict) -> tuple[float, int, list[list[int]]]:
    from elastic_hf import ElasticModel

    model = ElasticModel.from_pretrained(job["checkpoint"], dtype=job["dtype"], max_num_seqs=len(job["prompts"]),
                                         max_num_batched_tokens=job["max_num_batched_tokens"])
    model.generate(job["prompts"][:2], max_tokens=4, ignore_eos=True)   # warm-up
    start = time.perf_counter()
    outs = model.generate(job["prompts"], max_tokens=job["max_tokens"], ignore_eos=True)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs), [o.outputs[0].token_ids for o in outs]


def run_vllm(job: dict) -> tuple[float, int, list[list[int]]]:
    from vllm import LLM, SamplingParams

    # vLLM's own scheduling defaults: what a user who picks vLLM gets
    llm = LLM(model=job["checkpoint"], dtype=job["dtype"], max_model_len=job.get("max_model_len", 2048),
              seed=0)
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs), [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    job = json.loads(sys.stdin.read())
    run = run_elastic if job["engine"] == "elastic" else run_vllm
    elapsed, tokens, token_ids = run(job)
    print("JOB_RESULT " + json.dumps({"elapsed_s": elapsed, "tokens": tokens, "token_ids": token_ids}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
