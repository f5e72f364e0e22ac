"""Offline generation with elastic-hf: load a model, complete prompts (greedy and seeded sampling, one prompt
and a batch), chat through the model's chat template, stream tokens as they are decoded, and read the memory
ledger.

    .venv/bin/python examples/offline_generate.py                    # the embedded SmolLM2-135M-Instruct
    .venv/bin/python examples/offline_generate.py --model ./my-llama  # any local Llama/Qwen2/Mistral checkpoint
"""
import argparse

from elastic_hf import ElasticModel
from elastic_hf.units import format_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="checkpoint dir or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per completion")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="KV cache bytes, e.g. '256MiB'")
    args = parser.parse_args()

    # One worker, driven in this process. kv_cache_memory (or memory_budget) bounds what the KV cache commits.
    model = ElasticModel.from_pretrained(args.model, kv_cache_memory=args.kv_cache_memory)
    print(f"loaded {model.model_id}: max_model_len={model.max_model_len}")

    # 1. One prompt, greedy (offline calls default to temperature=0): deterministic, so it repeats exactly.
    out = model.generate("The capital of France is", max_tokens=args.max_tokens)
    print(f"greedy: {out.outputs[0].text!r}")
    again = model.generate("The capital of France is", max_tokens=args.max_tokens)
    print(f"greedy repeats: {again.outputs[0].token_ids == out.outputs[0].token_ids}")

    # 2. A batch of prompts: continuous batching runs them together; outputs come back in prompt order.
    prompts = ["Once upon a time", "def fibonacci(n):", "The three primary colors are"]
    for prompt, result in zip(prompts, model.generate(prompts, max_tokens=args.max_tokens)):
        print(f"batch: {prompt!r} -> {result.outputs[0].text!r}")

    # 3. Sampling with a seed: n=2 completions; the same seed gives the same completions again.
    sampling = dict(max_tokens=args.max_tokens, temperature=0.8, top_p=0.9, seed=1, n=2)
    sampled = model.generate("Once upon a time", **sampling)
    for completion in sampled.outputs:
        print(f"sampled[{completion.index}]: {completion.text!r}")
    resampled = model.generate("Once upon a time", **sampling)
    same = [c.token_ids for c in resampled.outputs] == [c.token_ids for c in sampled.outputs]
    print(f"seeded sampling repeats: {same}")

    # 4. Chat: a list of {"role", "content"} messages goes through the tokenizer's chat template.
    reply = model.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=args.max_tokens)
    print(f"chat: {reply.outputs[0].text!r}")

    # 5. Streaming: every RequestOutput carries the text decoded since the previous one in delta_text.
    print("stream: ", end="", flush=True)
    pieces = []
    for chunk in model.stream("def fibonacci(n):", max_tokens=args.max_tokens):
        delta = chunk.outputs[0].delta_text
        pieces.append(delta)
        print(delta, end="", flush=True)
    print()
    greedy_text = model.generate("def fibonacci(n):", max_tokens=args.max_tokens).outputs[0].text
    print(f"stream equals greedy generate: {''.join(pieces) == greedy_text}")

    # 6. Memory: bytes committed for the weights and the KV cache, and how many KV blocks that holds.
    report = model.memory_report()
    print(f"memory: weights {format_bytes(report['weights_bytes'])}, KV {format_bytes(report['kv_bytes'])} "
          f"({report['kv_blocks']} blocks of {report['kv_block_size']} tokens), "
          f"free {format_bytes(report['free_bytes'])} of budget {format_bytes(report['budget_bytes'])}")
    model.close()


if __name__ == "__main__":
    main()
