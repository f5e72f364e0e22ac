"""The one factory of tiny random-weight models for the tests (every family of patches/: Llama, Qwen2, Qwen3,
Mistral, Gemma 2, Gemma 3, Phi-3, OLMo 2, Granite, Qwen3-MoE, Mixtral): in memory
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


# What each family adds to TINY_SHAPES so its own mechanisms run: small sliding windows (24 tokens) that long
# prompts exceed, Gemma's alternating window/global layers and soft-caps, Phi-3's partial rotary, Granite's
# multipliers, a few experts for the MoE families.
_WINDOWED = ["sliding_attention", "full_attention", "sliding_attention"]
ARCH_EXTRAS = {
    "llama": {}, "qwen2": {}, "qwen3": {"head_dim": 16}, "olmo2": {},
    "mistral": {"sliding_window": 24},
    "gemma2": {"head_dim": 16, "sliding_window": 24, "layer_types": _WINDOWED, "query_pre_attn_scalar": 16,
               "attn_logit_softcapping": 20.0, "final_logit_softcapping": 15.0,
               "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3_text": {"head_dim": 16, "sliding_window": 24, "layer_types": _WINDOWED, "query_pre_attn_scalar": 16,
                    "final_logit_softcapping": 15.0},
    "phi3": {"partial_rotary_factor": 0.5, "sliding_window": None},
    "granite": {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
                "logits_scaling": 2.0},
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}
TINY_ARCHS = tuple(ARCH_EXTRAS)


def tiny_config(arch: str = "llama", **overrides):
    """A config of `arch` with TINY_SHAPES, any field overridden (num_hidden_layers=5, vocab_size=512, ...)."""
    from transformers import AutoConfig

    if arch not in ARCH_EXTRAS:
        raise ValueError(f"arch must be one of {sorted(ARCH_EXTRAS)}, got {arch!r}")
    common = dict(TINY_SHAPES, bos_token_id=1, eos_token_id=2, pad_token_id=2, **ARCH_EXTRAS[arch])
    common.update(overrides)
    if "layer_types" in common:   # one type a layer, whatever the layer count
        pattern = ARCH_EXTRAS[arch].get("layer_types", common["layer_types"])
        common["layer_types"] = [pattern[i % len(pattern)] for i in range(common["num_hidden_layers"])]
    return AutoConfig.for_model(arch, **common)


def tiny_hf_model(arch: str = "llama", seed: int = 0, bias_std: float = 0.2, **overrides):
    """A random-weight HF causal LM (fp32, eval, no grad; SDPA attention, eager where the family soft-caps its
    attention scores, which SDPA cannot)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    config._attn_implementation = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
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


def byte_tokenizer():
    """A byte-level BPE with no merges: "<unk>", "<s>", "</s>" and one token per byte (ids 3-258). Any text has a
    tokenization, so a grammar engine can constrain output to JSON or a regex on a machine without the default
    model (a GPU machine); model vocabularies above 259 leave the other ids without text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()   # the 256 printable stand-ins for bytes, in no fixed order
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{ch: 3 + i for i, ch in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


def build_tiny_checkpoint(arch: str, out_dir: Path, seed: int = 0, tokenizer: str = "default", **overrides) -> Path:
    """Save tiny_hf_model(arch, seed, **overrides) with a tokenizer to out_dir (once): the default model's, or
    minimal_tokenizer (tokenizer="minimal") or byte_tokenizer ("bytes"), which need no default model."""
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
    elif tokenizer == "bytes":
        byte_tokenizer().save_pretrained(tmp)
    else:
        AutoTokenizer.from_pretrained(resolve_model(None, dtype="float32").checkpoint_dir).save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir
