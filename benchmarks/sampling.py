"""What sampling costs per step, and what it takes from throughput, on the default model.

    python benchmarks/sampling.py [--batches 1 16 64] [--tokens 64] [--runs 3]

1. The sampler alone (engine/sampler.sample over the logits of one real decode step) for greedy rows,
   temperature, temperature + top-p 0.95, temperature + top-k 50 + top-p 0.9, and greedy with OpenAI's penalties.
   RESULT sampling_ms_<config>_b<B>.
2. End to end: `--batch` prompts generating `--tokens` tokens each, greedy against temperature 0.7 + top-p 0.95,
   alternating `--runs` times; medians with spread. RESULT sampled_vs_greedy_throughput (1.0: sampling is free).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description  # noqa: E402

CONFIGS = {"greedy": dict(temperature=0.0), "temperature": dict(temperature=0.7),
           "top_p": dict(temperature=0.7, top_p=0.95), "top_k_top_p": dict(temperature=0.7, top_k=50, top_p=0.9),
           "penalties": dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5)}


def sampler_cost(model, batches, repeats: int = 10) -> None:
    from elastic_hf import SamplingParams
    from elastic_hf.engine.sampler import make_sampler_state, sample
    from elastic_hf.engine.sequence import Sequence

    import elastic_hf.engine.llm_engine as llm_engine

    captured = []   # the logits of one real decode step of `max(batches)` sequences
    real_sample = llm_engine.sample
    llm_engine.sample = lambda logits, seqs, masks=None: (captured.append(logits.clone()),
                                                          real_sample(logits, seqs, masks))[1]
    model.generate([f"Story {i}: once upon a time" for i in range(max(batches))], max_tokens=3, temperature=0.0)
    llm_engine.sample = real_sample
    real = max(captured, key=len)                                                        # [rows, vocab]
    real = real.repeat(-(-max(batches) // len(real)), 1)                                 # [>= max batch, vocab]
    prompt = model.tokenizer.encode("Once upon a time, in a land far away, there lived a")
    print(f"{'config':>12} " + " ".join(f"{'b' + str(b) + ' ms':>10}" for b in batches))
    for name, options in CONFIGS.items():
        params = SamplingParams(max_tokens=256, seed=1, **options)
        row = []
        for batch in batches:
            seqs = []
            for i in range(batch):
                seq = Sequence(i, "bench", 0, list(prompt) + list(range(100, 164)), len(prompt), params, 0.0)
                seq.sampler_state = make_sampler_state(seq, 0, [model.tokenizer.eos_token_id])
                seqs.append(seq)
            logits = real[:batch].contiguous()
            sample(logits.clone(), seqs)
            start = time.perf_counter()
            for _ in range(repeats):
                sample(logits.clone(), seqs)
            row.append((time.perf_counter() - start) / repeats * 1e3)
        print(f"{name:>12} " + " ".join(f"{ms:>10.2f}" for ms in row))
        for batch, ms in zip(batches, row):
            print(f"RESULT sampling_ms_{name}_b{batch} {ms:.2f}")


def throughput(model, batch: int, tokens: int, runs: int) -> None:
    prompts = [f"Story {i}: once upon a time" for i in range(batch)]
    results = {"greedy": [], "sampled": []}
    for _ in range(runs):
        for name, options in (("greedy", dict(temperature=0.0)), ("sampled", dict(temperature=0.7, top_p=0.95))):
            start = time.perf_counter()
            outs = model.generate(prompts, max_tokens=tokens, ignore_eos=True, seed=1, **options)
            results[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    for name, values in results.items():
        print(f"{name:>8}: {statistics.median(values):.1f} tok/s [{min(values):.1f}-{max(values):.1f}]")
    ratio = statistics.median(results["sampled"]) / statistics.median(results["greedy"])
    print(f"RESULT sampled_vs_greedy_throughput {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--batch", type=int, default=64, help="prompts of the end-to-end run")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from elastic_hf import ElasticModel

    print(f"machine: {machine_description()}")
    model = ElasticModel.from_pretrained(None, max_model_len=512, max_num_seqs=max(args.batches + [args.batch]),
                                         kv_cache_memory=256 << 20, enable_prefix_caching=False)
    print(f"model: {model.model_id} ({model.config.dtype})")
    sampler_cost(model, args.batches)
    throughput(model, args.batch, args.tokens, args.runs)
    model.close()


if __name__ == "__main__":
    main()
