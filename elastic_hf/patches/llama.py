from elastic_hf.patches.base import ArchAdapter

LLAMA = ArchAdapter(model_types=("llama",))

# Granite is Llama's layer with multipliers inside HF's forward (embedding, residual, attention scale, logits); the
# decoder scales `inputs_embeds` itself, which a later pipeline stage's hidden states must not get again.
GRANITE = ArchAdapter(model_types=("granite",), rms_norm_class="GraniteRMSNorm",
                      stage_input_scale="embedding_multiplier")
