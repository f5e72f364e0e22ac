"""Profile which decoder layers matter least (MorphServe's Layer Importance Score, LIS) with `elastic-hf profile`,
then serve the model with precision morphing that swaps layers to INT4 in that order under memory pressure.

    .venv/bin/python examples/profile_layers.py                         # default model, about a minute on CPU
    .venv/bin/python examples/profile_layers.py --samples 8 --seq-len 512 --out smollm2-lis.json   # CLI defaults

The same from a shell: `elastic-hf profile [MODEL] --samples 4 --seq-len 128 --out lis.json`, then
`elastic-hf serve [MODEL] --morph default --morph-profile lis.json`.
"""
import argparse
import sys
from pathlib import Path

from elastic_hf import ElasticModel
from elastic_hf.profiling.profile_format import load_profile
from elastic_hf.serving.cli import main as cli_main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="checkpoint dir or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default="lis-profile.json", help="profile JSON to write")
    parser.add_argument("--samples", type=int, default=4, help="calibration sequences")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per calibration sequence")
    parser.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128],
                        help="W4 group size (must divide every linear's input dimension)")
    parser.add_argument("--awq-grid", type=int, default=5, help="AWQ alpha grid points")
    parser.add_argument("--calib", default=None, help="calibration text file (default: the shipped WikiText-2 text)")
    parser.add_argument("--max-tokens", type=int, default=24, help="new tokens of the final generation")
    parser.add_argument("--kv-cache-memory", default="128MiB", help="KV cache bytes of the served model")
    parser.add_argument("--no-progress", action="store_true", help="hide the profiler's progress bars")
    parser.add_argument("--no-variant-cache", action="store_true",
                        help="build the served model's quantized layer variants in memory only")
    args = parser.parse_args()

    # 1. Profile: quantize every layer to W4 (AWQ scales on calibration text), score each layer's importance and
    #    write the greedy swap order (least important first). This is exactly `elastic-hf profile ...`.
    cli_args = ["profile", *([args.model] if args.model else []), "--quant", "w4", "--method", "awq",
                "--group-size", str(args.group_size), "--samples", str(args.samples), "--seq-len", str(args.seq_len),
                "--awq-grid", str(args.awq_grid), "--out", args.out,
                *(["--calib", args.calib] if args.calib else []), *(["--no-progress"] if args.no_progress else [])]
    print("$ elastic-hf", " ".join(cli_args), flush=True)
    rc = cli_main(cli_args)
    if rc != 0:
        sys.exit(f"elastic-hf profile failed with exit code {rc}")

    # 2. Read it back: the order, and the score of each greedy step.
    profile = load_profile(Path(args.out))
    print(f"profile of {profile.model_id}: {profile.num_layers} layers, scheme {profile.scheme}")
    print(f"LIS order (first = swapped first): {profile.order}")
    for step in profile.steps[:3]:
        print(f"  step {step.step}: layer {step.layer} LIS={step.lis:.3f} (LTS={step.lts:.3f} LRS={step.lrs:.3f} "
              f"MDS={step.mds:.4f})")

    # 3. Serve it: morph="default" runs the controller (swap to W4 under KV pressure, back when load falls), in the
    #    profile's order. from_pretrained checks that the profile belongs to this model. The served variants use
    #    round-to-nearest scales unless morph_options={"calib_path": ...} asks for AWQ at load.
    model = ElasticModel.from_pretrained(
        args.model, morph="default", profile=args.out, kv_cache_memory=args.kv_cache_memory,
        morph_options={"w4_group_size": args.group_size, "use_cache": not args.no_variant_cache})
    state = model.morph.state()
    print(f"serving with morph={state['mode']}, controller on: {state['controller_enabled']}, "
          f"swap order {state['order']}")
    print(f"served order equals profile: {state['order'] == profile.order}")
    out = model.generate("The capital of France is", max_tokens=args.max_tokens)
    print(f"greedy: {out.outputs[0].text!r}")
    print(f"layers now: {model.morph.state()['layer_counts']}")   # no pressure: all full precision
    model.close()


if __name__ == "__main__":
    main()
