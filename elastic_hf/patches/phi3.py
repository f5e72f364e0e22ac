from elastic_hf.patches.base import ArchAdapter

# Phi-3 keeps q/k/v in one Linear and gate/up in another, with partial rotary in its own formula. Precision morphing
# quantizes the fused Linears as they are; sharding them would need splitting at load, which we do not do.
PHI3 = ArchAdapter(model_types=("phi3",), qkv_proj="self_attn.qkv_proj", gate_up_proj="mlp.gate_up_proj",
                   rms_norm_class="Phi3RMSNorm", rotary_function=None,
                   sharding_refusal="Phi-3 fuses q/k/v (qkv_proj) and gate/up (gate_up_proj) in single Linears, "
                                    "which tensor-parallel sharding does not split",
                   awq_refusal="Phi-3's fused qkv_proj/gate_up_proj are not in AWQ's per-projection search")
