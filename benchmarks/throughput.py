"""Offline throughput: elastic-hf vs HF continuous batching (generate_batch, paged|sdpa) vs HF static-batch
generate, same prompts, greedy, fp32, in one run.

    python benchmarks/throughput.py [--num-requests 32] [--max-new-tokens 64] [--min-prompt 32 --max-prompt 96]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, wikitext_prompts  # noqa: E402


def run_elastic(prompts, max_new_tokens, max_num_batched_tokens) -> tuple[float, int]:
    from elastic_hf import ElasticModel

    model = ElasticModel.from_pretrained(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=len(prompts))
    model.generate(prompts[:2], max_tokens=4, ignore_eos=True)  # warm-up
    start = time.perf_counter()
    outs = model.generate(prompts, max_tokens=max_new_tokens, ignore_eos=True)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_hf_static(prompts, max_new_tokens, checkpoint_dir) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    gen = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id or 2, eos_token_id=None)
    with torch.inference_mode():
        model.generate(**{k: v[:2] for k, v in batch.items()}, max_new_tokens=4, min_new_tokens=4, **gen)
        start = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, **gen)
        elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)


def run_hf_generate_batch(prompts, max_new_tokens, checkpoint_dir) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32,
                                                 attn_implementation="paged|sdpa")
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1,
                              min_new_tokens=max_new_tokens)
    # generate_batch runs its own generation thread and manages inference mode itself.
    model.generate_batch(prompts[:2], generation_config=config, max_new_tokens=4)
    start = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=config, max_new_tokens=max_new_tokens)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(r.generated_tokens) for r in results.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32, help="shortest prompt, tokens")
    parser.add_argument("--max-prompt", type=int, default=96, help="longest prompt, tokens")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="elastic-hf step token budget")
    parser.add_argument("--skip", nargs="*", default=[], choices=["elastic", "hf_cb", "hf_static"])
    args = parser.parse_args()

    from elastic_hf.model.loader import load_model_and_tokenizer, resolve_model

    checkpoint_dir = resolve_model(None).checkpoint_dir
    _, tokenizer, _ = load_model_and_tokenizer(None)
    prompts = wikitext_prompts(tokenizer, args.num_requests, args.min_prompt, args.max_prompt)
    print(f"machine: {machine_description()}")
    print(f"model: SmolLM2-135M-Instruct fp32; {args.num_requests} requests x {args.max_new_tokens} new tokens, "
          f"greedy; prompts {args.min_prompt}-{args.max_prompt} tokens from wikitext2 "
          f"({sum(map(len, prompts))} prompt tokens)")

    runners = {
        "elastic": lambda: run_elastic(prompts, args.max_new_tokens, args.max_num_batched_tokens),
        "hf_cb": lambda: run_hf_generate_batch(prompts, args.max_new_tokens, checkpoint_dir),
        "hf_static": lambda: run_hf_static(prompts, args.max_new_tokens, checkpoint_dir),
    }
    labels = {"elastic": "elastic-hf", "hf_cb": "HF generate_batch (paged|sdpa)", "hf_static": "HF static generate"}
    tok_per_s = {}
    for name in tqdm([n for n in runners if n not in args.skip], desc="engines"):
        elapsed, tokens = runners[name]()
        tok_per_s[name] = tokens / elapsed
        tqdm.write(f"{labels[name]:32s} {tokens:6d} tokens in {elapsed:7.2f} s = {tok_per_s[name]:7.1f} tok/s")
    if "elastic" in tok_per_s:
        for name in ("hf_cb", "hf_static"):
            if name in tok_per_s:
                print(f"elastic-hf / {labels[name]}: {tok_per_s['elastic'] / tok_per_s[name]:.2f}x")
        if "hf_cb" in tok_per_s:
            print(f"RESULT throughput_vs_hf_cb {tok_per_s['elastic'] / tok_per_s['hf_cb']:.3f}")
        if "hf_static" in tok_per_s:
            print(f"RESULT throughput_vs_hf_static {tok_per_s['elastic'] / tok_per_s['hf_static']:.3f}")


if __name__ == "__main__":
    main()
