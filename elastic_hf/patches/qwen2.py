from elastic_hf.patches.base import ArchAdapter

# Qwen2 carries biases on q/k/v (not on o); module names match Llama.
QWEN2 = ArchAdapter(model_types=("qwen2",), has_qkv_bias=True, rms_norm_class="Qwen2RMSNorm")

# Qwen3 drops the biases and normalises q and k per head inside HF's attention (q_norm, k_norm over head_dim): a
# head-sharded TP rank holds whole heads, so sharding needs nothing more.
QWEN3 = ArchAdapter(model_types=("qwen3",), rms_norm_class="Qwen3RMSNorm")
