"""Offline throughput: elastic-hf (with and without oneDNN prepacked weights) vs HF continuous batching
(generate_batch, paged|sdpa) vs HF static-batch generate, same prompts, greedy, all in one dtype (--dtype, default
float32), in one run.

    python benchmarks/throughput.py [--dtype {float32,bfloat16}] [--num-requests 32] [--max-new-tokens 64]
                                    [--min-prompt 32 --max-prompt 96] [--repeats 3]

Each engine is loaded once, then timed `--repeats` times, round-robin, so slow phases of a shared machine hit
every engine alike; the ratios compare medians.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, wikitext_prompts  # noqa: E402


class ElasticRunner:
    label = "elastic-hf"
    packed_weights = "auto"

    def __init__(self, prompts, max_new_tokens, max_num_batched_tokens, checkpoint_dir, dtype):
        from elastic_hf import ElasticModel

        self.prompts, self.max_new_tokens = prompts, max_new_tokens
        self.model = ElasticModel.from_pretrained(max_num_batched_tokens=max_num_batched_tokens,
                                                  max_num_seqs=len(prompts), dtype=dtype,
                                                  packed_weights=self.packed_weights)
        self.model.generate(prompts[:2], max_tokens=4, ignore_eos=True)  # warm-up

    def run(self) -> tuple[float, int]:
        start = time.perf_counter()
        outs = self.model.generate(self.prompts, max_tokens=self.max_new_tokens, ignore_eos=True)
        elapsed = time.perf_counter() - start
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


class ElasticUnpackedRunner(ElasticRunner):
    """The engine before oneDNN prepacked weights (layers/packed_linear.py): what packing gains, in the same run."""
    label = "elastic-hf, unpacked weights"
    packed_weights = "off"


class HfStaticRunner:
    label = "HF static generate"

    def __init__(self, prompts, max_new_tokens, max_num_batched_tokens, checkpoint_dir, dtype):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype,
                                                          attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
        tokenizer.padding_side = "left"
        self.batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
        self.num_prompts, self.max_new_tokens = len(prompts), max_new_tokens
        self.gen = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id or 2, eos_token_id=None)
        with torch.inference_mode():
            self.model.generate(**{k: v[:2] for k, v in self.batch.items()}, max_new_tokens=4, min_new_tokens=4,
                                **self.gen)

    def run(self) -> tuple[float, int]:
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(**self.batch, max_new_tokens=self.max_new_tokens,
                                      min_new_tokens=self.max_new_tokens, **self.gen)
            elapsed = time.perf_counter() - start
        return elapsed, (out.shape[1] - self.batch["input_ids"].shape[1]) * self.num_prompts


class HfGenerateBatchRunner:
    label = "HF generate_batch (paged|sdpa)"

    def __init__(self, prompts, max_new_tokens, max_num_batched_tokens, checkpoint_dir, dtype):
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype,
                                                          attn_implementation="paged|sdpa")
        self.config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1,
                                       min_new_tokens=max_new_tokens)
        self.prompts, self.max_new_tokens = prompts, max_new_tokens
        # generate_batch runs its own generation thread and manages inference mode itself.
        self.model.generate_batch(prompts[:2], generation_config=self.config, max_new_tokens=4)

    def run(self) -> tuple[float, int]:
        start = time.perf_counter()
        results = self.model.generate_batch(self.prompts, generation_config=self.config,
                                            max_new_tokens=self.max_new_tokens)
        elapsed = time.perf_counter() - start
        return elapsed, sum(len(r.generated_tokens) for r in results.values())


RUNNERS = {"elastic": ElasticRunner, "elastic_unpacked": ElasticUnpackedRunner, "hf_cb": HfGenerateBatchRunner,
           "hf_static": HfStaticRunner}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="weights and activations of every engine")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32, help="shortest prompt, tokens")
    parser.add_argument("--max-prompt", type=int, default=96, help="longest prompt, tokens")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="elastic-hf step token budget")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per engine, interleaved round by round; ratios use the medians "
                             "(a shared 2-core VM varies by up to 20%% between runs)")
    parser.add_argument("--skip", nargs="*", default=[], choices=list(RUNNERS))
    args = parser.parse_args()

    from elastic_hf.model.loader import load_model_and_tokenizer, resolve_model

    checkpoint_dir = resolve_model(None).checkpoint_dir
    _, tokenizer, _ = load_model_and_tokenizer(None)
    prompts = wikitext_prompts(tokenizer, args.num_requests, args.min_prompt, args.max_prompt)
    print(f"machine: {machine_description()}")
    dtype = getattr(torch, args.dtype)
    print(f"model: SmolLM2-135M-Instruct {args.dtype}; {args.num_requests} requests x {args.max_new_tokens} new tokens, "
          f"greedy; prompts {args.min_prompt}-{args.max_prompt} tokens from wikitext2 "
          f"({sum(map(len, prompts))} prompt tokens); {args.repeats} interleaved runs per engine")

    names = [n for n in RUNNERS if n not in args.skip]
    runners = {name: RUNNERS[name](prompts, args.max_new_tokens, args.max_num_batched_tokens, checkpoint_dir, dtype)
               for name in tqdm(names, desc="loading engines")}
    samples: dict[str, list[float]] = {name: [] for name in names}
    with tqdm(total=args.repeats * len(names), desc="timed runs") as bar:
        for round_index in range(args.repeats):
            for name in names:
                elapsed, tokens = runners[name].run()
                samples[name].append(tokens / elapsed)
                tqdm.write(f"round {round_index + 1}: {runners[name].label:32s} {tokens:6d} tokens in "
                           f"{elapsed:7.2f} s = {tokens / elapsed:7.1f} tok/s")
                bar.update(1)
    tok_per_s = {name: statistics.median(values) for name, values in samples.items()}
    print("\nmedian tok/s (min-max):")
    for name in names:
        print(f"  {runners[name].label:32s} {tok_per_s[name]:7.1f}  ({min(samples[name]):.1f}-{max(samples[name]):.1f})")
    suffix = "" if args.dtype == "float32" else "_bf16"   # the fp32 names predate --dtype
    if "elastic" in tok_per_s:
        for name in ("hf_cb", "hf_static"):
            if name in tok_per_s:
                print(f"elastic-hf / {runners[name].label}: {tok_per_s['elastic'] / tok_per_s[name]:.2f}x")
        if "hf_cb" in tok_per_s:
            print(f"RESULT throughput_vs_hf_cb{suffix} {tok_per_s['elastic'] / tok_per_s['hf_cb']:.3f}")
        if "hf_static" in tok_per_s:
            print(f"RESULT throughput_vs_hf_static{suffix} {tok_per_s['elastic'] / tok_per_s['hf_static']:.3f}")
        if "elastic_unpacked" in tok_per_s:
            print(f"RESULT packed_weights_speedup{suffix} {tok_per_s['elastic'] / tok_per_s['elastic_unpacked']:.3f}")


if __name__ == "__main__":
    main()
