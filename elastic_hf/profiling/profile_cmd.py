"""Offline LIS layer ordering for precision morphing (MorphServe §4.2): quantize every decoder layer (W4/W8, RTN
or AWQ), score the layers with LTS/LRS/MDS on calibration text and write the greedy swap order as JSON.
With --evaluate, also print the MorphServe Table 8 comparison: perplexity on held-out text with k layers
quantized under LIS, front-to-back, back-to-front and random orders (table + PNG plot)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from elastic_hf.layers.awq import AwqConfig
from elastic_hf.layers.cpu_gemm import use_onednn_linears
from elastic_hf.layers.quant_scheme import QuantScheme
from elastic_hf.layers.quantize_layer import calibrate_and_quantize, decoder_layer_kwargs, reference_layer
from elastic_hf.paths import describe_data_path
from elastic_hf.profiling.calibration import calibration_batch, default_calibration_text, held_out_split, tokenize_file
from elastic_hf.profiling.lis import profile_lis
from elastic_hf.profiling.perplexity import PerplexityEvaluator, eval_windows, order_sweep
from elastic_hf.profiling.profile_format import MDS_METRICS, NORMALIZATIONS, LisConfig, fallback_order, load_profile

SWEEP_KS = (0, 1, 2, 4, 8, 16)
RANDOM_SEEDS = (0, 1, 2)
_LIS_DEFAULTS = LisConfig()  # the CLI's defaults are the library's


def default_out_path(checkpoint_dir: Path, model_id: str) -> Path:
    name = f"lis-profile-{model_id}.json"
    if os.access(checkpoint_dir, os.W_OK):
        return checkpoint_dir / name
    return Path.cwd() / name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="local HF checkpoint directory or .gguf file; omit for the embedded default model")
    parser.add_argument("--quant", default="w4", help="quantization scheme of the layer variants: w4 or w8")
    parser.add_argument("--group-size", type=int, default=None,
                        help="W4 group size along the input dimension: 32, 64 or 128 (default 64; must divide "
                             "every linear's input dimension); ignored for w8")
    parser.add_argument("--method", default="awq", help="how the quantization scales are chosen: awq or rtn")
    parser.add_argument("--calib", default=None,
                        help="calibration text file (default: the WikiText-2 validation text shipped in the package, "
                             "elastic_hf/data/wikitext2-valid.txt)" + "%(default).0s")
    parser.add_argument("--samples", type=int, default=8, help="number of calibration sequences")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence")
    parser.add_argument("--seed", type=int, default=0, help="seed for the calibration windows (same seed, same profile)")
    parser.add_argument("--out", default=None,
                        help="output JSON (default: lis-profile-<model>.json next to the checkpoint if writable, "
                             "else in the working directory)")
    parser.add_argument("--alpha1", type=float, default=0.25, help="LIS weight of LTS (MorphServe eq. 5)")
    parser.add_argument("--alpha2", type=float, default=0.25, help="LIS weight of LRS (MorphServe eq. 5)")
    parser.add_argument("--beta", type=float, default=0.5, help="LIS weight of MDS (MorphServe eq. 5)")
    parser.add_argument("--normalize", default=_LIS_DEFAULTS.normalize, choices=list(NORMALIZATIONS),
                        help="scale LTS, LRS and MDS by their spread over the layers before weighting (minmax: "
                             "to [0, 1]; zscore: by the standard deviation; none: the raw cosines of eq. 5, where "
                             "the widely spread LTS outweighs MDS whatever the weights)")
    parser.add_argument("--mds-metric", default=_LIS_DEFAULTS.mds_metric, choices=list(MDS_METRICS),
                        help="MDS similarity: cosine of the final normed hidden states; kl: exp(-KL) between "
                             "the next-token distributions with and without the candidate quantized; nll: the "
                             "calibration perplexity ratio ppl_Q / ppl_Q+p (kl and nll cost the LM head per "
                             "candidate)")
    parser.add_argument("--mds-samples", type=int, default=_LIS_DEFAULTS.mds_samples,
                        help="calibration sequences used for the greedy MDS (the costly part); LTS/LRS/AWQ use all")
    parser.add_argument("--refresh", type=int, default=3,
                        help="lazy greedy: candidates re-scored per step after the first (0 = re-score all, "
                             "Algorithm 1 verbatim, about 10x slower)")
    parser.add_argument("--awq-grid", type=int, default=10, help="AWQ: number of alpha grid points in [0, 1)")
    parser.add_argument("--save-variants", default=None,
                        help="directory to also write each quantized layer as layer-<i>.safetensors")
    parser.add_argument("--variants", default=None,
                        help="directory of layer-<i>.safetensors written by --save-variants: use these quantized "
                             "layers instead of quantizing again (their scheme overrides --quant/--method)")
    parser.add_argument("--evaluate", action="store_true",
                        help="print the Table 8 comparison (perplexity vs number of quantized layers per order)")
    parser.add_argument("--eval-text", default=None,
                        help="held-out evaluation text (default: the calibration file; then the first half of "
                             "its tokens calibrates and the second half evaluates)")
    parser.add_argument("--profile", default=None,
                        help="existing profile JSON to evaluate instead of profiling first (with --evaluate)")
    parser.add_argument("--eval-windows", type=int, default=8, help="number of evaluation windows")
    parser.add_argument("--eval-seq-len", type=int, default=512, help="tokens per evaluation window")
    parser.add_argument("--plot", default=None, help="PNG path for the Table 8 plot (default: next to the JSON)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def _build_variants(model, adapter, scheme, calib_ids, awq_config):
    """Quantized variant + reference copy of every layer (for --evaluate with an existing profile)."""
    layers = adapter.decoder_layers(model)
    kwargs = decoder_layer_kwargs(model, *calib_ids.shape)
    hidden = model.get_submodule(adapter.embed_tokens)(calib_ids).float()  # [samples, seq, hidden]
    references = {}
    for i, layer in enumerate(layers):
        calibrated = calibrate_and_quantize(layer, adapter, model.config, scheme, hidden, kwargs, awq_config,
                                            with_reference=True)
        references[i] = calibrated.reference
        hidden = calibrated.fp_output if calibrated.fp_output is not None else layer(hidden, **kwargs)
    return references


def load_variants(directory: Path, model, adapter) -> tuple[dict[int, torch.nn.Module], QuantScheme]:
    from elastic_hf.layers.quantize_layer import load_layer_variant

    layers = adapter.decoder_layers(model)
    missing = [i for i in range(len(layers)) if not (directory / f"layer-{i}.safetensors").is_file()]
    if missing:
        raise FileNotFoundError(f"--variants {directory}: no layer-<i>.safetensors for layers {missing}")
    variants = {i: load_layer_variant(directory / f"layer-{i}.safetensors", layer, adapter)
                for i, layer in enumerate(layers)}
    schemes = {v.quant_scheme for v in variants.values()}
    if len(schemes) != 1:
        raise ValueError(f"--variants {directory}: layers use different schemes {sorted(s.name for s in schemes)}")
    return variants, schemes.pop()


def format_table(results: dict[str, dict[int, float]], ks: list[int], num_layers: int) -> str:
    labels = [f"{k} (fp32)" if k == 0 else f"{k} (all)" if k == num_layers else str(k) for k in ks]
    width = max(12, *(len(label) + 2 for label in labels))
    lines = ["method".ljust(16) + "".join(label.rjust(width) for label in labels)]
    for name, row in results.items():
        lines.append(name.ljust(16) + "".join(f"{row[k]:.4f}".rjust(width) for k in ks))
    return "\n".join(lines)


def save_plot(results: dict[str, dict[int, float]], ks: list[int], path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("the Table 8 plot needs matplotlib: pip install 'elastic-hf[plots]' (the table above "
                           "has the same numbers)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    positions = list(range(len(ks)))
    for name, row in results.items():
        axis.plot(positions, [row[k] for k in ks], marker="o", label=name)
    axis.set_xticks(positions, [str(k) for k in ks])
    axis.set_xlabel("quantized decoder layers (k)")
    axis.set_ylabel("perplexity (held-out)")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run(args) -> int:
    return report_usage_errors("profile", _run, args)


def report_usage_errors(command: str, body, args) -> int:
    """Bad input (a missing file, an invalid flag value) is one line on stderr and exit code 2, not a traceback."""
    try:
        return body(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"elastic-hf {command}: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    scheme = QuantScheme.create(args.quant, args.group_size, args.method)
    lis_config = LisConfig(alpha1=args.alpha1, alpha2=args.alpha2, beta=args.beta, samples=args.samples,
                           seq_len=args.seq_len, seed=args.seed, mds_samples=args.mds_samples, refresh=args.refresh,
                           normalize=args.normalize, mds_metric=args.mds_metric)
    awq_config = AwqConfig(num_grid=args.awq_grid, seed=args.seed)
    if args.profile and not args.evaluate:
        raise ValueError("--profile only makes sense with --evaluate")
    calib_path = Path(args.calib) if args.calib else default_calibration_text()
    eval_path = Path(args.eval_text) if args.eval_text else calib_path

    from elastic_hf.model.loader import load_model_and_tokenizer
    from elastic_hf.patches import get_adapter

    torch.manual_seed(args.seed)
    model, tokenizer, resolved = load_model_and_tokenizer(args.model)
    adapter = get_adapter(model.config)
    layers = adapter.decoder_layers(model)
    for name in adapter.linear_names():
        scheme.check_in_features(layers[0].get_submodule(name).in_features, name)
    calib_tokens = tokenize_file(tokenizer, calib_path, "calib")
    eval_tokens = None
    # Held out: when evaluating (or when --eval-text names the calibration file) on the calibration file, the
    # first half of its tokens calibrates and the second half evaluates, so a profile made for a later
    # --evaluate --profile run never saw the evaluation text.
    if args.evaluate or args.eval_text:
        if eval_path.resolve() == calib_path.resolve():
            calib_tokens, eval_tokens = held_out_split(calib_tokens)
        elif args.evaluate:
            eval_tokens = tokenize_file(tokenizer, eval_path, "eval_text")
    calib_ids = calibration_batch(calib_tokens, lis_config.samples, lis_config.seq_len, lis_config.seed)
    out_path = Path(args.out) if args.out else default_out_path(resolved.checkpoint_dir, resolved.model_id)

    references = None
    prebuilt = None
    if args.variants:
        prebuilt, scheme = load_variants(Path(args.variants), model, adapter)
        references = {i: reference_layer(v) for i, v in prebuilt.items()}
        print(f"loaded {len(prebuilt)} {scheme.name} layer variants from {args.variants}")
    if args.profile:
        profile = load_profile(args.profile, model.config)
        scheme = profile.scheme
        print(f"loaded LIS profile {args.profile} ({scheme.name}): order {profile.order}")
    else:
        print(f"profiling {resolved.model_id}: {len(layers)} layers, {scheme.name}, calibration "
              f"{lis_config.samples} x {lis_config.seq_len} tokens from {describe_data_path(calib_path)}, LIS weights "
              f"{lis_config.alpha1}/{lis_config.alpha2}/{lis_config.beta} on "
              + ("raw" if lis_config.normalize == "none" else f"{lis_config.normalize}-normalised")
              + f" terms, MDS by {lis_config.mds_metric}")
        result = profile_lis(model, adapter, calib_ids, scheme, lis_config, awq_config, resolved.model_id,
                             describe_data_path(calib_path), progress=not args.no_progress, prebuilt=prebuilt)
        profile = result.profile
        references = result.references
        profile.save(out_path)
        print(f"order: {profile.order}")
        print(f"timings: {profile.timings}")
        print(f"wrote {out_path}")
        if args.save_variants:
            from elastic_hf.layers.quantize_layer import save_layer_variant
            directory = Path(args.save_variants)
            directory.mkdir(parents=True, exist_ok=True)
            for i, variant in result.variants.items():
                save_layer_variant(directory / f"layer-{i}.safetensors", variant, i, resolved.model_id)
            print(f"wrote {len(result.variants)} layer variants to {directory}")
    if not args.evaluate:
        return 0

    started = time.perf_counter()
    if references is None:
        references = _build_variants(model, adapter, scheme, calib_ids, awq_config)
    windows = eval_windows(eval_tokens, args.eval_seq_len, args.eval_windows)
    use_onednn_linears(model, *references.values())  # forwards only from here: oneDNN where it is faster
    evaluator = PerplexityEvaluator(model, adapter, windows)
    num_layers = len(layers)
    ks = sorted({k for k in SWEEP_KS if k < num_layers} | {num_layers})
    orders = {"LIS": profile.order, "front-to-back": fallback_order(num_layers),
              "back-to-front": fallback_order(num_layers)[::-1]}
    for seed in RANDOM_SEEDS:
        generator = torch.Generator().manual_seed(seed)
        orders[f"random-{seed}"] = torch.randperm(num_layers, generator=generator).tolist()
    print(f"evaluating on {windows.shape[0]} x {windows.shape[1]} held-out tokens from {describe_data_path(eval_path)}"
          + (" (second half; calibration used the first half)" if eval_path.resolve() == calib_path.resolve() else ""))
    results = order_sweep(evaluator, references, orders, ks,
                          on_result=None if args.no_progress else
                          lambda name, k, value: print(f"  {name:>14} k={k:<3} ppl={value:.4f}", flush=True))
    table = {name: results[name] for name in ("front-to-back", "back-to-front")}
    table["random (mean 3)"] = {k: sum(results[f"random-{s}"][k] for s in RANDOM_SEEDS) / len(RANDOM_SEEDS)
                                for k in ks}
    table["LIS"] = results["LIS"]
    print(f"\nTable 8 ({resolved.model_id}, {scheme.name}, perplexity on held-out text, "
          f"{time.perf_counter() - started:.0f} s):")
    print(format_table(table, ks, num_layers))
    plot_path = Path(args.plot) if args.plot else out_path.with_name(out_path.stem + "-table8.png")
    try:
        save_plot(table, ks, plot_path, f"{resolved.model_id} {scheme.name}: perplexity vs quantized layers")
    except RuntimeError as exc:
        if args.plot:  # asked for by name: an error; the default plot next to the JSON is only skipped
            raise
        print(f"no plot: {exc}", file=sys.stderr)
        return 0
    print(f"wrote {plot_path}")
    return 0
