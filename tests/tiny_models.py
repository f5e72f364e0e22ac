"""The one factory of tiny random-weight models for the tests (Llama, Qwen2, Mistral): in memory
(`tiny_hf_model`) or saved as a checkpoint with the default model's real tokenizer (`build_tiny_checkpoint`).

The defaults use a larger init scale than HF's so greedy choices have clear margins and exactness tests compare
model behaviour, not float round-off between near-equal logits; q/k/v biases (Qwen2) are random so they matter."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

TINY_SHAPES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=1024, vocab_size=49152,
                   tie_word_embeddings=False, initializer_range=0.2)


def tiny_config(arch: str = "llama", **overrides):
    """A config of `arch` with TINY_SHAPES, any field overridden (num_hidden_layers=5, vocab_size=512, ...)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(TINY_SHAPES, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if arch == "mistral":
        common["sliding_window"] = 24  # small window: exercised by long prompts
    common.update(overrides)
    configs = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}  # qwen2: q/k/v biases
    if arch not in configs:
        raise ValueError(f"arch must be one of {sorted(configs)}, got {arch!r}")
    return configs[arch](**common)


def tiny_hf_model(arch: str = "llama", seed: int = 0, bias_std: float = 0.2, **overrides):
    """A random-weight HF causal LM (fp32, eval, no grad, SDPA attention)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases default to zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, bias_std)
    return model.eval().requires_grad_(False)


def minimal_tokenizer(vocab_size: int):
    """A word-level tokenizer over `vocab_size` made-up words ("<unk>", "<s>", "</s>", "w3", ...): for checkpoints on
    machines without the default model (a GPU machine), where tests feed token ids and only need the tokenizer to
    exist and decode."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


def build_tiny_checkpoint(arch: str, out_dir: Path, seed: int = 0, tokenizer: str = "default", **overrides) -> Path:
    """Save tiny_hf_model(arch, seed, **overrides) with a tokenizer to out_dir (once): the default model's, or
    (tokenizer="minimal") minimal_tokenizer, which needs no default model."""
    from transformers import AutoTokenizer

    from elastic_hf.model.loader import resolve_model

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    model = tiny_hf_model(arch, seed, **overrides)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if tokenizer == "minimal":
        minimal_tokenizer(model.config.vocab_size).save_pretrained(tmp)
    else:
        AutoTokenizer.from_pretrained(resolve_model(None).checkpoint_dir).save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir
