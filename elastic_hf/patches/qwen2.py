from elastic_hf.patches.base import ArchAdapter

# Qwen2 carries biases on q/k/v (not on o); module names match Llama.
QWEN2 = ArchAdapter(model_types=("qwen2",), has_qkv_bias=True, rms_norm_class="Qwen2RMSNorm")
