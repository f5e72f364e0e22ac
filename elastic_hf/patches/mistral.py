from elastic_hf.patches.base import ArchAdapter

# Mistral's sliding window is honoured by the paged attention (config.sliding_window); names match Llama.
MISTRAL = ArchAdapter(model_types=("mistral",), rms_norm_class="MistralRMSNorm")
