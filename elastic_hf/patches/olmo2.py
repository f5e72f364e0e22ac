from elastic_hf.patches.base import ArchAdapter

# OLMo 2 normalises after each block (post_attention_layernorm, post_feedforward_layernorm; no pre-norms) and
# applies q_norm / k_norm over the whole projection (all heads at once), so a rank holding some heads cannot
# compute them alone. Its RMSNorm multiplies before casting back (differs from Llama's in bf16).
OLMO2 = ArchAdapter(model_types=("olmo2",), input_norm=None, mlp_norm=None,
                    layer_norms=("post_attention_layernorm", "post_feedforward_layernorm"), rms_norm_class=None,
                    sharding_refusal="OLMo 2's q_norm/k_norm normalise over all heads of a token at once: a "
                                     "head-sharded rank cannot compute them",
                    awq_refusal="OLMo 2 has no pre-norm for AWQ to fold its input scales into")
