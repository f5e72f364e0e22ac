"""Random-weight checkpoints in the shapes of real models, for timing engines where no weights can be downloaded.

    python benchmarks/model_shapes.py qwen2.5-1.5b [--out DIR]     # prints the checkpoint's directory

A step's cost depends on the shapes (layers, hidden and MLP widths, heads, vocabulary), not on the weights' values,
so a checkpoint with a real model's config.json and random weights times like the real one (greedy outputs differ,
and with ignore_eos every request makes exactly its max_tokens). Weights are saved in bf16 (an fp32 run upcasts them).
The checkpoint carries a word-level tokenizer of the model's vocabulary size (tests/tiny_models.minimal_tokenizer),
so both engines can detokenize whatever random weights produce; prompts are token ids, which benchmarks make with
the default model's tokenizer (`prompt_tokenizer`: ids below 49,152, valid in every vocabulary here). Checkpoints
are cached under ~/.cache/elastic-hf/shapes/ (ELASTIC_HF_SHAPES_DIR to move it).

The configs are those of the models' config.json files on the Hub (rope scaling left out: it does not change a
step's cost at these lengths)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MARKER = "elastic_hf_random_shape.json"

_SMOLLM2 = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)
_QWEN25 = dict(model_type="qwen2", vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
               rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False)
SHAPES: dict[str, dict] = {
    "smollm2-135m": _SMOLLM2,
    "qwen2.5-0.5b": dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5,
                         rope_theta=500000.0),
    "qwen2.5-1.5b": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2),
    "qwen2.5-3b": dict(_QWEN25, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2),
}
_SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)


def shapes_dir() -> Path:
    return Path(os.environ.get("ELASTIC_HF_SHAPES_DIR", Path.home() / ".cache" / "elastic-hf" / "shapes"))


def random_checkpoint(shape: str, out_dir: str | Path | None = None, seed: int = 0) -> Path:
    """The checkpoint directory of `shape` (a key of SHAPES) with random bf16 weights, written once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiny_models import minimal_tokenizer

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; one of {sorted(SHAPES)}")
    out = Path(out_dir) if out_dir is not None else shapes_dir() / shape
    if (out / MARKER).exists():
        return out
    spec = dict(SHAPES[shape], **_SPECIAL)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"   # random init of billions of weights: seconds on a GPU
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    minimal_tokenizer(config.vocab_size).save_pretrained(tmp)
    parameters = sum(p.numel() for p in model.parameters())
    (tmp / MARKER).write_text(json.dumps({"shape": shape, "parameters": parameters, "seed": seed}))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def is_random_shape(checkpoint: str | Path) -> bool:
    return (Path(checkpoint) / MARKER).exists()


def prompt_tokenizer(checkpoint: str | Path):
    """The tokenizer that turns benchmark text into token-id prompts for `checkpoint`: its own, or for a random-shape
    checkpoint (whose word-level tokenizer would turn text into unknown words) the default model's."""
    from transformers import AutoTokenizer

    if is_random_shape(checkpoint):
        from elastic_hf.model.loader import resolve_model

        return AutoTokenizer.from_pretrained(resolve_model(None).checkpoint_dir)
    return AutoTokenizer.from_pretrained(checkpoint)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--out", default=None, help="directory (default: the shapes cache)")
    args = parser.parse_args()
    path = random_checkpoint(args.shape, args.out)
    info = json.loads((path / MARKER).read_text())
    print(f"{path}  ({info['parameters'] / 1e9:.2f}B parameters, random bf16 weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
