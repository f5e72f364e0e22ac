"""Resolve a model source and load the Hugging Face model and tokenizer.

Sources: a local HF checkpoint directory, a `.gguf` file, or None for the embedded default model. A GGUF file is
de-quantized once by transformers (about 20 s) and cached as a safetensors checkpoint under the user cache
directory, so later loads take well under two seconds.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from elastic_hf.model.default_model import DEFAULT_MODEL_ID, default_gguf_path
from elastic_hf.paths import cache_root

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass(slots=True)
class ResolvedModel:
    checkpoint_dir: Path   # a directory `from_pretrained` can read (safetensors + config + tokenizer)
    model_id: str          # the name served in /v1/models


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _gguf_cache_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{key}"


def convert_gguf(gguf_path: Path) -> Path:
    """De-quantize a GGUF file into a cached fp32 safetensors checkpoint; returns its directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = _gguf_cache_dir(gguf_path)
    if (out_dir / "model.safetensors").exists() and (out_dir / "config.json").exists():
        return out_dir
    log.info("converting %s to a safetensors checkpoint in %s (once)", gguf_path, out_dir)
    tmp_dir = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The de-quantized weights are plain fp32 now; drop the gguf marker so save_pretrained accepts the model.
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    if out_dir.exists():  # another process finished the same conversion first: keep its copy
        shutil.rmtree(tmp_dir, ignore_errors=True)
    else:
        tmp_dir.rename(out_dir)
    return out_dir


def resolve_model(name_or_path: str | os.PathLike | None) -> ResolvedModel:
    if name_or_path is None:
        return ResolvedModel(convert_gguf(default_gguf_path()), DEFAULT_MODEL_ID)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return ResolvedModel(convert_gguf(path), path.stem)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint: config.json is missing")
        return ResolvedModel(path, path.name)
    raise FileNotFoundError(
        f"model {str(name_or_path)!r} is neither a local checkpoint directory nor a .gguf file; "
        "models cannot be downloaded from a hub here. Omit the model to use the embedded default "
        f"({DEFAULT_MODEL_ID})")


def load_hf_model(checkpoint_dir: Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """The untouched HF model (eval mode, no grad) and its tokenizer."""
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


def load_model_and_tokenizer(name_or_path=None, dtype=None, attn_implementation: str = "sdpa"):
    """Convenience for tools (profiler, benchmarks): resolve + load. Returns (model, tokenizer, ResolvedModel)."""
    resolved = resolve_model(name_or_path)
    model, tokenizer = load_hf_model(resolved.checkpoint_dir, parse_dtype(dtype), attn_implementation)
    return model, tokenizer, resolved
