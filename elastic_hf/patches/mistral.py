from elastic_hf.patches.base import ArchAdapter

# Mistral's sliding window (config.sliding_window, every layer) is honoured by the paged attention; names match Llama.
MISTRAL = ArchAdapter(model_types=("mistral",), rms_norm_class="MistralRMSNorm")
