from elastic_hf.patches.base import ArchAdapter

# Gemma 2 and 3: four norms a layer (a post-norm after attention and after the MLP, a pre-norm before the MLP), all
# of the form x * (1 + weight), so not Llama's kernel and not a place AWQ can fold a scale into by division; scaled
# embeddings, query_pre_attn_scalar and the final logit soft-cap live in HF's forward. Sliding-window and global
# layers alternate (per layer, read from the attention modules); Gemma 2 soft-caps the attention scores, which the
# paged attention does on its exact path (kv/attention_backends.py). gelu(gate) * up shards like SwiGLU.
_GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")
_AWQ = "Gemma's norms scale by (1 + weight): AWQ's scales do not fold into them; use RTN variants (no calibration)"

GEMMA2 = ArchAdapter(model_types=("gemma2",), mlp_norm="pre_feedforward_layernorm", layer_norms=_GEMMA_NORMS,
                     rms_norm_class=None, awq_refusal=_AWQ)
GEMMA3 = ArchAdapter(model_types=("gemma3_text",), module_name="gemma3", mlp_norm="pre_feedforward_layernorm",
                     layer_norms=_GEMMA_NORMS, rms_norm_class=None, awq_refusal=_AWQ)
