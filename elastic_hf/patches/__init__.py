"""One adapter per supported HF architecture."""
from elastic_hf.patches.base import ArchAdapter
from elastic_hf.patches.llama import LLAMA
from elastic_hf.patches.mistral import MISTRAL
from elastic_hf.patches.qwen2 import QWEN2

_ADAPTERS: dict[str, ArchAdapter] = {t: a for a in (LLAMA, QWEN2, MISTRAL) for t in a.model_types}


def supported_model_types() -> list[str]:
    return sorted(_ADAPTERS)


def get_adapter(config) -> ArchAdapter:
    model_type = getattr(config, "model_type", None)
    if model_type not in _ADAPTERS:
        raise ValueError(
            f"architecture {model_type!r} is not supported; supported model types: {', '.join(supported_model_types())}")
    return _ADAPTERS[model_type]


__all__ = ["ArchAdapter", "get_adapter", "supported_model_types"]
