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


def step_logits(model, prompts, max_tokens: int) -> list[torch.Tensor]:
    """The logits of every step of a greedy batch on an in-process ElasticModel (chunked prefills and decodes
    mixed), as its runner returns them."""
    runner = model.instances[0].engine.runner
    seen, execute = [], runner.execute

    def recording(inputs):
        logits = execute(inputs)
        seen.append(logits.clone())
        return logits

    runner.execute = recording
    try:
        model.generate(prompts, max_tokens=max_tokens)
    finally:
        runner.execute = execute
    return seen


# The tolerance policy for bf16 near-ties (tests/model/test_bf16.py states it).
TIE_MARGIN = 0.25   # logit units: 4 bf16 ulps at |logit| in [8, 16), where the default model's top logits lie


@torch.inference_mode()
def hf_greedy_with_logits(model, prompt: list[int], max_new: int,
                          device: str = "cpu") -> tuple[list[int], list[torch.Tensor]]:
    """HF generate's greedy tokens and the logits of each step, the reference of the bf16 near-tie policy."""
    ids = torch.tensor([prompt], device=device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [step[0].float().cpu() for step in out.logits]


def assert_greedy_equal_up_to_ties(tokens: list[int], reference: list[int], logits: list[torch.Tensor]) -> bool:
    """True when equal throughout; False when they part at a near-tie (allowed); fails otherwise."""
    for i, (got, want) in enumerate(zip(tokens, reference)):
        if got == want:
            continue
        top2 = logits[i].topk(2).values
        margin = float(top2[0] - top2[1])
        gap = float(logits[i][want] - logits[i][got])
        assert gap <= TIE_MARGIN, (f"token {i}: engine chose {got}, HF {want}; HF's logit gap between them is "
                                   f"{gap:.3f} (top-2 margin {margin:.3f}), more than a bf16 near-tie "
                                   f"({TIE_MARGIN})")
        return False
    assert len(tokens) == len(reference), f"{len(tokens)} tokens, HF made {len(reference)}"
    return True
