from elastic_hf.patches.base import ArchAdapter

# Mixture-of-experts families: the attention is Llama's (Qwen3-MoE adds Qwen3's per-head q/k norms); the MLP is a
# router plus experts held as 3-D tensors, run by HF's own forward. Precision morphing quantizes the attention
# Linears only (experts stay full precision); tensor parallelism would need expert sharding and is refused.
_SHARDING = "its experts are 3-D tensors that tensor-parallel sharding does not split (experts stay whole)"

QWEN3_MOE = ArchAdapter(model_types=("qwen3_moe",), is_moe=True, rms_norm_class="Qwen3MoeRMSNorm",
                        sharding_refusal="Qwen3-MoE: " + _SHARDING, awq_refusal="AWQ searches dense MLPs only")
MIXTRAL = ArchAdapter(model_types=("mixtral",), is_moe=True, rms_norm_class="MixtralRMSNorm",
                      sharding_refusal="Mixtral: " + _SHARDING, awq_refusal="AWQ searches dense MLPs only")
