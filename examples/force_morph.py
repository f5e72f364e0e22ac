"""Precision morphing by hand: swap decoder layers of a running model to INT4 weights, watch the freed memory turn
into KV cache blocks, then swap them back to full precision and get the exact original greedy output again.

With morph="manual" nothing swaps on its own; with morph="default" (or "accuracy"/"performance") a controller
swaps layers under KV pressure and restores them when load falls (see README: Precision morphing).

    .venv/bin/python examples/force_morph.py
    .venv/bin/python examples/force_morph.py --layers 0,1,2      # only some layers
"""
import argparse

from elastic_hf import ElasticModel
from elastic_hf.units import format_bytes

PROMPT = "The capital of France is"


def show(title: str, model: ElasticModel, fp_blocks: int | None = None) -> int:
    """Print the morph state and memory ledger; returns the KV block count."""
    state = model.morph.state()       # instance 0: per-layer precision, KV capacity, swap counts
    memory = model.memory_report()
    blocks = state["kv_blocks_total"]
    grown = "" if fp_blocks is None else f" ({blocks - fp_blocks:+d} vs fp)"
    print(f"[{title}] layers {state['layer_counts']}, KV blocks {blocks}{grown}, swaps {state['swaps']}")
    print(f"[{title}] memory: weights {format_bytes(memory['weights_bytes'])}, KV {format_bytes(memory['kv_bytes'])}, "
          f"free {format_bytes(memory['free_bytes'])}")
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="checkpoint dir or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--layers", default="all", help="'all' or comma-separated layer indices, e.g. 0,1,2")
    parser.add_argument("--precision", default="w4", choices=["w4", "w8"], help="precision to swap the layers to")
    parser.add_argument("--max-tokens", type=int, default=24, help="new tokens per completion")
    parser.add_argument("--kv-cache-memory", default="128MiB", help="initial KV cache bytes")
    parser.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128],
                        help="W4 group size (must divide every linear's input dimension)")
    parser.add_argument("--no-variant-cache", action="store_true",
                        help="build the quantized layer variants in memory only (default: cache them on disk)")
    args = parser.parse_args()
    layers = "all" if args.layers == "all" else [int(i) for i in args.layers.split(",")]

    # morph="manual": every layer's fp/W8/W4 variants are built at load (RTN scales; pass
    # morph_options={"calib_path": ...} for AWQ) and kept in host memory; only to_precision() swaps them.
    model = ElasticModel.from_pretrained(
        args.model, morph="manual", kv_cache_memory=args.kv_cache_memory,
        morph_options={"w4_group_size": args.group_size, "use_cache": not args.no_variant_cache})

    original = model.generate(PROMPT, max_tokens=args.max_tokens).outputs[0]
    print(f"fp greedy: {original.text!r}")
    fp_blocks = show("fp", model)

    # Swap the layers to INT4. to_precision waits until the swap is done and returns the new state(); the weight
    # pages the layers gave up are handed to the KV cache as new blocks.
    model.morph.to_precision(layers, args.precision)
    show(args.precision, model, fp_blocks)
    quantized = model.generate(PROMPT, max_tokens=args.max_tokens).outputs[0]
    print(f"{args.precision} greedy: {quantized.text!r}")

    # Back to full precision: the KV blocks the morph added are detached (free ones only) and the exact fp
    # weights are copied back from host memory, so greedy decoding is bit-identical to the first run.
    model.morph.to_precision("all", "fp")
    show("restored", model, fp_blocks)
    restored = model.generate(PROMPT, max_tokens=args.max_tokens).outputs[0]
    print(f"restored greedy: {restored.text!r}")
    print(f"restored equals original: {restored.token_ids == original.token_ids}")
    model.close()


if __name__ == "__main__":
    main()
