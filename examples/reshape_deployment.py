"""Reshape a live multi-worker deployment: two worker processes start as two TP-1 instances, merge in place into
one TP-2 instance (weights re-sharded, KV cache migrated by head ranges, nothing reloaded), split back, become a
two-stage pipeline (1x2: layers and KV split by stage) and back, and morph one instance's layers to INT4 on its
own.

    .venv/bin/python examples/reshape_deployment.py

The `if __name__ == "__main__":` guard is required: the worker processes are spawned and re-import this file.
"""
import argparse

from elastic_hf import ElasticModel
from elastic_hf.units import format_bytes

PROMPTS = ["The capital of France is", "Once upon a time"]


def greedy(model: ElasticModel, max_tokens: int) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in model.generate(PROMPTS, max_tokens=max_tokens)]


def show(report) -> None:
    # ReshapeReport: old/new topology, whether the transaction committed, its duration, requests moved.
    print(f"reshape {report.old} -> {report.new}: committed={report.committed} seconds={report.seconds:.3f} "
          f"num_moved_seqs={report.num_moved_seqs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="checkpoint dir or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens per completion")
    parser.add_argument("--kv-cache-memory", default="64MiB", help="KV cache bytes per worker")
    parser.add_argument("--no-variant-cache", action="store_true",
                        help="build the quantized layer variants in memory only (default: cache them on disk)")
    args = parser.parse_args()

    # workers=2: two worker processes joined by torch.distributed (gloo on CPU); by default each is a TP-1
    # instance and requests are routed between them. morph="manual" lets us force precision swaps per instance.
    with ElasticModel.from_pretrained(args.model, workers=2, kv_cache_memory=args.kv_cache_memory, morph="manual",
                                      morph_options={"use_cache": not args.no_variant_cache}) as model:
        print(f"topology {model.deployment.topology}: {len(model.instances)} instances")
        before = greedy(model, args.max_tokens)
        print(f"[1,1] greedy: {model.tokenizer.decode(before[0])!r}")

        # Merge the two TP-1 instances into one TP-2 instance, in place, while a request is decoding: reshape
        # between two steps of a stream (the server does the same on its engine thread, POST /admin/reshape).
        # The request's KV cache moves with it (num_moved_seqs) and it finishes with exactly the same tokens.
        merged = False
        for chunk in model.stream(PROMPTS[1], max_tokens=args.max_tokens):
            if not merged and len(chunk.outputs[0].token_ids) >= 3 and not chunk.finished:
                show(model.reshape([2]))
                merged = True
        print(f"request decoded across the reshape equals [1,1] greedy: {chunk.outputs[0].token_ids == before[1]}")
        print(f"topology {model.deployment.topology}: {len(model.instances)} instance(s), "
              f"KV blocks {model.memory_report()['kv_blocks_total']}")
        print(f"[2] greedy equals [1,1]: {greedy(model, args.max_tokens) == before}")

        # ... and split it back.
        show(model.reshape([1, 1]))
        print(f"[1,1] greedy equals [1,1]: {greedy(model, args.max_tokens) == before}")

        # A two-stage pipeline on the same workers: each stage holds only its layers (weights and KV), so the
        # pipeline holds far more KV than two TP-1 instances; the KV cache moves by layer range (ReMP).
        show(model.reshape(["1x2"]))
        report = model.memory_report()
        print(f"[1x2] stages hold layers {[w['layers'] for w in report['workers']]}, "
              f"KV blocks {report['kv_blocks_total']}")
        print(f"[1x2] greedy equals [1,1]: {greedy(model, args.max_tokens) == before}")
        show(model.reshape([1, 1]))

        # Precision morphing runs per TP-1 instance: swap instance 1's layers to INT4; instance 0 is untouched.
        state = model.morph.to_precision("all", "w4", instance=1)
        print(f"instance 1 morphed: layers {state['layer_counts']}, KV blocks {state['kv_blocks_total']}; "
              f"instance 0: layers {model.morph.state(0)['layer_counts']}")
        for worker in model.memory_report()["workers"]:
            print(f"  worker ledger: weights {format_bytes(worker['weights_bytes'])}, "
                  f"KV {format_bytes(worker['kv_bytes'])}, {worker['kv_blocks']} blocks")
        # A reshape first brings morphed layers back to full precision (a TP shard is always full precision).
        show(model.reshape([2]))
        print(f"[2] greedy equals [1,1]: {greedy(model, args.max_tokens) == before}")
        show(model.reshape([1, 1]))
        print(f"after split: layers {[s['layer_counts'] for s in model.morph.states()]}")
    # leaving the with-block called model.close(): the worker processes are stopped


if __name__ == "__main__":
    main()
