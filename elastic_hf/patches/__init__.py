"""The architecture adapters: one generic ArchAdapter (patches/base.py) and, per family, only what differs from
Llama. A model type without an entry runs on Llama's names: HF's own forward does the work and the paged attention
comes in through AttentionInterface, so any decoder-only model whose attention goes through it is served;
`ArchAdapter.checked_against` refuses the elastic operations whose modules such a model lacks."""
import logging

from elastic_hf.patches.base import ArchAdapter
from elastic_hf.patches.gemma import GEMMA2, GEMMA3
from elastic_hf.patches.llama import GRANITE, LLAMA
from elastic_hf.patches.mistral import MISTRAL
from elastic_hf.patches.moe import MIXTRAL, QWEN3_MOE
from elastic_hf.patches.olmo2 import OLMO2
from elastic_hf.patches.phi3 import PHI3
from elastic_hf.patches.qwen2 import QWEN2, QWEN3

log = logging.getLogger(__name__)
_warned: set[str] = set()

_FAMILIES = (LLAMA, QWEN2, QWEN3, MISTRAL, GEMMA2, GEMMA3, PHI3, OLMO2, GRANITE, QWEN3_MOE, MIXTRAL)
_ADAPTERS: dict[str, ArchAdapter] = {t: a for a in _FAMILIES for t in a.model_types}


def supported_model_types() -> list[str]:
    """The model types with a family entry (tested: README's table); others run on the generic adapter."""
    return sorted(_ADAPTERS)


def get_adapter(config) -> ArchAdapter:
    model_type = getattr(config, "model_type", None)
    if not model_type:
        raise ValueError("the model config has no model_type: not a Hugging Face checkpoint config")
    adapter = _ADAPTERS.get(model_type) or _generic_adapter(model_type)
    # A pre-quantized checkpoint (its config's quantization_config, on the checkpoint's and on the loaded model's
    # config alike) serves at that precision: no morphing, no sharding.
    quant = getattr(config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return adapter.prequantized(str(method).upper()) if method else adapter


def _generic_adapter(model_type: str) -> ArchAdapter:
    if model_type not in _warned:
        _warned.add(model_type)
        log.warning("model type %r has no family entry (tested: %s): serving it with the generic adapter (HF's "
                    "own forward; precision morphing where its layers have Llama's Linears; one worker)",
                    model_type, ", ".join(supported_model_types()))
    return ArchAdapter(model_types=(model_type,), rms_norm_class=None, rotary_function=None,
                       sharding_refusal=f"model type {model_type!r} has no family entry in elastic_hf/patches, and "
                                        "sharding is verified per family")


__all__ = ["ArchAdapter", "get_adapter", "supported_model_types"]
