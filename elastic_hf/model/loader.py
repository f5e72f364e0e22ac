"""Resolve a model source and load the Hugging Face model and tokenizer.

Sources: a local HF checkpoint directory, a `.gguf` file, a Hub repo id (model/hub.py), or None for the embedded
default model. A GGUF file is de-quantized once by transformers (about 20 s for the default model) straight into the
dtype asked for, one tensor at a time (no full-precision copy of the model on the way), and cached as a safetensors
checkpoint under the user cache directory, keyed by the file's content and the dtype, so later loads take well
under two seconds.

dtype "auto" (vLLM's default) is the checkpoint's own dtype (config.json `dtype` / `torch_dtype`; float32 when it
names none), float16 on a CPU becoming bfloat16 as vLLM's CPU backend does; for a GGUF file, whose weights have no
float dtype, bfloat16 where the device computes it natively and float32 elsewhere (config.auto_dtype)."""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from elastic_hf.model.default_model import DEFAULT_MODEL_ID, default_gguf_path
from elastic_hf.paths import (file_content_key, private_temp_dir, publish_dir, sweep_stale_temps,
                              trusted_cache_dir)

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass(slots=True)
class ResolvedModel:
    checkpoint_dir: Path   # a directory `from_pretrained` can read (safetensors + config + tokenizer)
    model_id: str          # the name served in /v1/models: the repo id of a Hub model
    dtype: str = "float32"   # the dtype to run: the one asked for, or what "auto" means for this source


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _gguf_cache_dir(gguf_path: Path, dtype: torch.dtype) -> Path:
    """Keyed by the file's content (sha256 of its bytes: a reinstall or copy of the same file hits the cache, an
    edited file misses it) and the dtype, in the private cache (paths.trusted_cache_dir)."""
    return trusted_cache_dir("gguf") / f"{gguf_path.stem}-{file_content_key(gguf_path)}-" \
                                       f"{str(dtype).removeprefix('torch.')}"


def convert_gguf(gguf_path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """De-quantize a GGUF file into a cached safetensors checkpoint in `dtype`; returns its directory. transformers
    de-quantizes one tensor at a time and casts it at once, so the peak is the model in `dtype` plus one tensor in
    fp32 (tests/model/test_loading.py measures it)."""
    out_dir = _gguf_cache_dir(gguf_path, dtype)
    if (out_dir / "model.safetensors").exists() and (out_dir / "config.json").exists():
        return out_dir
    log.info("converting %s to a %s safetensors checkpoint in %s (once)", gguf_path, dtype, out_dir)
    sweep_stale_temps(out_dir.parent)   # what a crashed conversion left
    tmp_dir = private_temp_dir(out_dir.parent, out_dir.name)
    try:
        _convert_into(gguf_path, dtype, tmp_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return publish_dir(tmp_dir, out_dir)   # a concurrent start that finished first keeps its copy


def _convert_into(gguf_path: Path, dtype: torch.dtype, tmp_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype)
    # The de-quantized weights are plain tensors now; drop the gguf marker so save_pretrained accepts the model.
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)


def resolve_model(name_or_path: str | os.PathLike | None, *, dtype: str = "auto", device: str = "cpu",
                  revision: str | None = None, download_dir: str | None = None, token: str | bool | None = None,
                  trust_remote_code: bool = False) -> ResolvedModel:
    """Where the checkpoint of `name_or_path` is (converting a GGUF file, fetching a Hub repo), its served name and
    the dtype it runs in ("auto" resolved as the module docstring says)."""
    from elastic_hf.config import auto_dtype
    from elastic_hf.model.hub import hub_snapshot, looks_like_repo_id, repo_id_of_snapshot

    if name_or_path is None or str(name_or_path).endswith(".gguf"):
        gguf = default_gguf_path() if name_or_path is None else Path(name_or_path).expanduser()
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF file {gguf} does not exist")
        chosen = auto_dtype(device)[0] if dtype == "auto" else dtype
        model_id = DEFAULT_MODEL_ID if name_or_path is None else gguf.stem
        return ResolvedModel(convert_gguf(gguf, parse_dtype(chosen)), model_id, chosen)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint: config.json is missing")
        model_id = repo_id_of_snapshot(path) or path.name
    elif not path.exists() and looks_like_repo_id(str(name_or_path)):
        path = hub_snapshot(str(name_or_path), revision=revision, cache_dir=download_dir, token=token,
                            trust_remote_code=trust_remote_code)
        model_id = str(name_or_path)
    else:
        raise FileNotFoundError(
            f"model {str(name_or_path)!r} is neither a local checkpoint directory, a .gguf file nor a Hub repo id "
            f"('org/name'). Omit the model to use the embedded default ({DEFAULT_MODEL_ID})")
    return ResolvedModel(path, model_id, checkpoint_dtype(path, device) if dtype == "auto" else dtype)


def checkpoint_dtype(checkpoint_dir: Path, device: str = "cpu") -> str:
    """What dtype "auto" means for a checkpoint: the dtype its config.json names (float32 when none), float16 on a
    CPU becoming bfloat16 (vLLM's CPU backend does the same: CPU kernels have no fast float16)."""
    import json

    config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    named = config.get("dtype") or config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
    chosen = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(str(named), "float32")
    if chosen == "float16" and device.split(":")[0] == "cpu":
        log.info("dtype auto: the checkpoint is float16; running bfloat16 on the CPU")
        chosen = "bfloat16"
    return chosen


def load_hf_model(checkpoint_dir: Path, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
    """The untouched HF model (eval mode, no grad) and its tokenizer. attn_implementation: None lets transformers
    pick (SDPA where the architecture supports it; eager for Gemma 2's soft-capped scores)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype, attn_implementation=attn_implementation)
    model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    return model, tokenizer


def eos_token_ids(checkpoint_dir: Path, tokenizer=None) -> list[int]:
    """Every token that ends a generation: the generation config's EOS ids (several for some chat models), else the
    model config's, plus the tokenizer's EOS token."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(checkpoint_dir).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = getattr(AutoConfig.from_pretrained(checkpoint_dir), "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def set_chat_template(tokenizer, template: str) -> None:
    """Replace the tokenizer's chat template (EngineConfig.chat_template: Jinja text or a file holding it). Jinja
    that does not parse is a ValueError at startup rather than a failure of every chat request later."""
    import jinja2

    from elastic_hf.config import load_chat_template

    text = load_chat_template(template)
    tokenizer.chat_template = text
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                      add_generation_prompt=True)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template is not valid Jinja: {exc.message} (line {exc.lineno} of "
                         f"{text[:200]!r})") from None
    except Exception:  # noqa: BLE001 - it parses; it may refuse this conversation shape, as requests will learn
        pass


def load_model_and_tokenizer(name_or_path=None, dtype=None, attn_implementation: str | None = None):
    """Convenience for tools (profiler, benchmarks): resolve + load (dtype None: float32, the tools' reference).
    Returns (model, tokenizer, ResolvedModel)."""
    resolved = resolve_model(name_or_path, dtype=dtype or "float32")
    model, tokenizer = load_hf_model(resolved.checkpoint_dir, parse_dtype(resolved.dtype), attn_implementation)
    return model, tokenizer, resolved
