"""elastic-hf: serve Hugging Face causal LMs and reshape a live deployment under load."""
from importlib.metadata import PackageNotFoundError, version as _package_version

from elastic_hf.config import EngineConfig, MorphConfig
from elastic_hf.engine.outputs import CompletionOutput, RequestOutput
from elastic_hf.engine.sampling_params import RequestOutputKind, SamplingParams
from elastic_hf.engine.structured_outputs import StructuredOutputsParams

__all__ = ["ElasticModel", "EngineConfig", "MorphConfig", "SamplingParams", "StructuredOutputsParams",
           "RequestOutputKind", "RequestOutput", "CompletionOutput"]
try:
    VERSION = _package_version("elastic-hf")   # one place: pyproject.toml
except PackageNotFoundError:  # a source tree on sys.path without an install
    VERSION = "0.0.0+source"
__version__ = VERSION


def __getattr__(name: str):
    # Importing the model pulls in transformers; keep `import elastic_hf` (and `elastic-hf --help`) light.
    if name == "ElasticModel":
        from elastic_hf.elastic_model import ElasticModel

        return ElasticModel
    raise AttributeError(f"module 'elastic_hf' has no attribute {name!r}")
