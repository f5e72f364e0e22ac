"""Pre-quantized AWQ checkpoints (AutoAWQ's GEMM layout, layers/awq_format.py) loaded straight into W4 layers: the
model is built on the meta device, every Linear the checkpoint quantized becomes a W4Linear holding the file's
4-bit values (never de-quantized, never a full-precision copy), and only the rest (embeddings, norms, LM head,
biases) is materialized from the file. transformers' own AWQ path needs the gptqmodel package and CUDA kernels;
this one runs on the core aten int4 kernels, CPU and CUDA.

Such a model serves at W4 as it is: precision morphing needs the full-precision weights to morph up to, which an
AWQ checkpoint does not hold, and sharding needs Linear weights to cut (patches/base.ArchAdapter.prequantized)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from elastic_hf.layers.awq_format import from_awq_gemm
from elastic_hf.layers.w4_linear import W4Linear


def awq_quantization(checkpoint_dir: str | Path) -> dict | None:
    """The checkpoint's AWQ quantization_config, checked to be a layout we read; None for an unquantized one."""
    config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method != "awq":
        raise ValueError(f"{checkpoint_dir} is quantized with {method!r}; elastic-hf reads AWQ checkpoints (AutoAWQ "
                         "GEMM layout) and unquantized ones (and quantizes at run time by precision morphing)")
    bits, version = quant.get("bits", quant.get("w_bit")), str(quant.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or not quant.get("zero_point", True):
        raise ValueError(f"AWQ checkpoint {checkpoint_dir}: bits={bits}, version={version!r}, zero_point="
                         f"{quant.get('zero_point', True)}; supported: 4 bits, GEMM layout, with zero points")
    return quant


@torch.no_grad()
def load_awq_model(checkpoint_dir: str | Path, dtype: torch.dtype, attn_implementation: str,
                   trust_remote_code: bool = False) -> nn.Module:
    """The HF model of an AWQ checkpoint with W4Linear layers, in eval mode on the CPU."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    quant = awq_quantization(checkpoint_dir)
    group_size = int(quant.get("group_size", quant.get("q_group_size", 128)))
    config = AutoConfig.from_pretrained(checkpoint_dir, trust_remote_code=trust_remote_code)
    config.__dict__.pop("quantization_config", None)   # the model is built plain; its Linears are replaced below
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {checkpoint_dir}")
    where = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            where.update({name: str(path) for name in f.keys()})

    def tensor(name: str) -> torch.Tensor:
        with safe_open(where[name], framework="pt") as f:
            return f.get_tensor(name)

    for prefix in sorted(name.removesuffix(".qweight") for name in where if name.endswith(".qweight")):
        linear = model.get_submodule(prefix)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"AWQ checkpoint quantizes {prefix!r}, which is a {type(linear).__name__} here")
        q, scales, zeros = from_awq_gemm(tensor(f"{prefix}.qweight"), tensor(f"{prefix}.qzeros"),
                                         tensor(f"{prefix}.scales"), group_size)
        if q.shape != (linear.out_features, linear.in_features):
            raise ValueError(f"AWQ tensors of {prefix} are {tuple(q.shape)}, the model's Linear "
                             f"[{linear.out_features}, {linear.in_features}]")
        bias = tensor(f"{prefix}.bias") if f"{prefix}.bias" in where else None
        parent, _, attr = prefix.rpartition(".")
        setattr(model.get_submodule(parent), attr, W4Linear.from_quantized(q, scales, zeros, group_size, bias, "cpu"))
    _materialize(model, tensor, where, dtype)
    if getattr(config.get_text_config(), "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"AWQ checkpoint {checkpoint_dir} lacks {len(left)} tensors the model needs, e.g. {left[:3]}")
    # Back on the built model's config: it says what the model is, and patches.get_adapter reads it there (as from
    # the checkpoint's config) to refuse morphing and sharding. Nothing in HF's forward reads it.
    model.config.quantization_config = quant
    return model.eval().requires_grad_(False)


def _materialize(model: nn.Module, tensor, where: dict, dtype: torch.dtype) -> None:
    """Meta buffers computed as HF initializes them (rotary tables, scales), then every meta parameter the file
    holds, cast to `dtype`."""
    for module in model.modules():
        meta = [name for name, b in module._buffers.items() if b is not None and b.is_meta]
        if meta:
            for name in meta:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            model._init_weights(module)   # HF's own initialization of non-persistent buffers (params stay meta)
    for name, param in list(model.named_parameters()):
        if param.is_meta and name in where:
            parent, _, attr = name.rpartition(".")
            value = tensor(name)
            module = model.get_submodule(parent)
            module._parameters[attr] = nn.Parameter(value.to(dtype) if value.is_floating_point() else value,
                                                    requires_grad=False)
