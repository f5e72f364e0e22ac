"""Greedy continuations from an untouched HF model, one prompt at a time (no padding), as the exactness oracle."""
from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF generate's greedy tokens, cut before the first EOS (the engine leaves EOS out of its output)."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False)[0, len(prompt_ids):].tolist()
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    for i, token in enumerate(out):
        if token in eos_ids:
            return out[:i]
    return out


def mixed_prompts(tokenizer, num_prompts: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of mixed lengths cut from real text (the WikiText-2 text shipped with the package)."""
    import random

    from elastic_hf.paths import default_calibration_text

    text = default_calibration_text().read_text()[:200_000]
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        length = rng.randint(min_len, max_len)
        start = rng.randint(0, len(ids) - length - 1)
        prompts.append(ids[start:start + length])
    return prompts
