"""Build the quantized variants (W8, W4) of every decoder layer once, and cache them on disk.

RTN needs no data; AWQ (when a calibration text is given) runs the full-precision model layer by layer on the
calibration windows and searches each layer's scales on its real input (helper functions of layers/ and
morph/lis). Variants are cached as portable safetensors (layers/quantize_layer.save_layer_variant) under the
user cache dir, keyed by the checkpoint's files, the config and the scheme, so a later load only re-packs
them for the device (about 0.05 s per layer instead of building them again)."""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from torch import nn

from elastic_hf.config import QUANT_PRECISIONS, MorphConfig
from elastic_hf.layers.awq import AwqConfig
from elastic_hf.layers.quant_scheme import QuantScheme
from elastic_hf.layers.quantize_layer import (calibrate_and_quantize, decoder_layer_kwargs, load_layer_variant,
                                              save_layer_variant)
from elastic_hf.paths import file_content_key, private_temp_dir, sweep_stale_temps, trusted_cache_dir
from elastic_hf.profiling.calibration import calibration_batch, read_text
from elastic_hf.profiling.profile_format import config_hash

log = logging.getLogger(__name__)

PRECISIONS = ("fp",) + QUANT_PRECISIONS   # highest to lowest


def variant_scheme(config: MorphConfig, precision: str) -> QuantScheme:
    return QuantScheme.create(precision, config.w4_group_size if precision == "w4" else None, config.method)


def checkpoint_fingerprint(checkpoint_dir: Path, hf_config) -> str:
    """The weight files' contents (sha256 of their bytes, hashed once per process: paths.file_content_key) plus the
    config hash: a file replaced with one of the same size and mtime does not serve stale variants."""
    h = hashlib.sha256()
    for path in sorted(Path(checkpoint_dir).glob("*")):
        if path.suffix in (".safetensors", ".bin", ".gguf", ".pt"):
            h.update(f"{path.name}:{file_content_key(path)}".encode())
    h.update(config_hash(hf_config).encode())
    return h.hexdigest()[:16]


def _file_digest(path: str) -> str:
    return file_content_key(path)[:12]


def variant_dir(config: MorphConfig, precision: str, checkpoint_dir: Path, hf_config) -> Path:
    root = Path(config.cache_dir) if config.cache_dir else trusted_cache_dir("morph-variants")
    name = variant_scheme(config, precision).name
    if config.method == "awq":
        name += f"-{_file_digest(config.calib_path)}-n{config.calib_samples}x{config.calib_seq_len}"
    return root / checkpoint_fingerprint(checkpoint_dir, hf_config) / name


@contextlib.contextmanager
def _sdpa_attention(model: nn.Module):
    """Calibration calls decoder layers directly, outside the paged engine: use HF's SDPA while it runs."""
    config = model.config
    saved = config._attn_implementation
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = saved


def calibration_ids(tokenizer, config: MorphConfig) -> torch.Tensor:
    """[calib_samples, calib_seq_len] token windows of the calibration text. Only a prefix of the text is
    tokenized (16 windows' worth, ~8 characters per token): tokenizing a whole corpus file costs seconds."""
    text = read_text(config.calib_path, "calib_path")
    needed_chars = 16 * config.calib_samples * config.calib_seq_len * 8
    ids = tokenizer(text[:needed_chars], add_special_tokens=False, return_tensors="pt").input_ids[0]
    return calibration_batch(ids, config.calib_samples, config.calib_seq_len, seed=0)


def _calibration_hidden(model, adapter, batch: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    return model.get_submodule(adapter.embed_tokens)(batch.to(device)).float()  # [samples, seq, hidden]


@torch.no_grad()
def _build(model, adapter, layers, calib: torch.Tensor | None, config: MorphConfig,
           precision: str) -> list[nn.Module]:
    scheme = variant_scheme(config, precision)
    if config.method == "rtn":
        return [calibrate_and_quantize(layer, adapter, model.config, scheme).quantized for layer in layers]
    variants = []
    with _sdpa_attention(model):
        hidden = _calibration_hidden(model, adapter, calib)
        kwargs = decoder_layer_kwargs(model, hidden.shape[0], hidden.shape[1])
        for layer in layers:
            calibrated = calibrate_and_quantize(layer, adapter, model.config, scheme, hidden, kwargs, AwqConfig())
            variants.append(calibrated.quantized)
            hidden = calibrated.fp_output  # the next layer calibrates on full-precision activations
    return variants


def _load_cached(directory: Path, layers, adapter, device) -> list[nn.Module] | None:
    paths = [directory / f"layer-{i:03d}.safetensors" for i in range(len(layers))]
    if not all(p.is_file() for p in paths):
        return None
    try:
        return [load_layer_variant(p, layer, adapter, device) for p, layer in zip(paths, layers)]
    except Exception as exc:  # a stale or truncated cache entry is rebuilt, never fatal
        log.warning("ignoring the layer-variant cache in %s: %s", directory, exc)
        return None


def _save_cached(directory: Path, variants: list[nn.Module], model_id: str) -> None:
    """Write into a private temporary directory and rename it into place, so a concurrent reader (TP workers build
    at once) never sees half a cache entry. An entry already there is stale (it failed to load) or was just
    written by another process: either way it is replaced, and no temporary directory is left behind."""
    stale = directory.with_name(directory.name + f".stale{os.getpid()}")
    tmp = None
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale_temps(directory.parent)
        tmp = private_temp_dir(directory.parent, directory.name)
        for i, variant in enumerate(variants):
            save_layer_variant(tmp / f"layer-{i:03d}.safetensors", variant, i, model_id)
        if directory.exists():
            directory.rename(stale)
        tmp.rename(directory)
    except OSError as exc:  # a read-only cache dir only costs the next load a rebuild
        log.warning("could not cache layer variants in %s: %s", directory, exc)
    finally:
        for leftover in (tmp, stale):
            if leftover is not None:
                shutil.rmtree(leftover, ignore_errors=True)


def build_variants(model: nn.Module, adapter, layers: nn.ModuleList, config: MorphConfig,
                   checkpoint_dir: Path | None, model_id: str = "") -> dict[str, list[nn.Module]]:
    """precision -> one quantized copy per decoder layer, on the layers' device. AWQ (config.calib_path) reads
    the checkpoint's tokenizer to tokenize the calibration text."""
    device = next(layers[0].parameters()).device
    out: dict[str, list[nn.Module]] = {}
    calib = None
    for precision in config.precisions:
        started = time.perf_counter()
        directory = variant_dir(config, precision, checkpoint_dir, model.config) \
            if config.use_cache and checkpoint_dir is not None else None
        variants = _load_cached(directory, layers, adapter, device) if directory is not None else None
        source = "cache"
        if variants is None:
            if config.method == "awq" and calib is None:
                from transformers import AutoTokenizer

                calib = calibration_ids(AutoTokenizer.from_pretrained(checkpoint_dir), config)
            variants = _build(model, adapter, layers, calib, config, precision)
            source = config.method
            if directory is not None:
                _save_cached(directory, variants, model_id)
        log.info("%s variants of %d layers (%s) in %.1f s", variant_scheme(config, precision).name, len(layers), source,
                 time.perf_counter() - started)
        out[precision] = variants
    return out
