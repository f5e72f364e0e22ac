from elastic_hf.patches.base import ArchAdapter

LLAMA = ArchAdapter(model_types=("llama",))
