"""Precision morphing of a bf16 model: the W8/W4 variants are built from the bf16 weights, free weight bytes,
decode sensibly, and morphing back restores the bf16 weights bit for bit."""
from __future__ import annotations

import pytest
import torch

from morph_helpers import assert_bit_identical, snapshot, tiny_morph_model


def top3(model, prompt: list[int]) -> list[int]:
    first = model.generate(prompt, max_tokens=1, ignore_eos=True, logprobs=3).outputs[0].logprobs[0]
    return [token_id for token_id, *_ in first.top]


@pytest.mark.outer_only
def test_w8_w4_variants_from_a_bf16_base_and_back(tiny_checkpoint):
    model = tiny_morph_model(tiny_checkpoint("llama"), dtype="bfloat16")
    assert {p.dtype for p in model.worker.hf_model.parameters()} == {torch.bfloat16}
    original = snapshot(model)
    prompt = list(range(3, 40))
    fp_tokens = model.generate(prompt, max_tokens=16, ignore_eos=True).outputs[0].token_ids
    fp_top = top3(model, prompt)
    weights_fp = model.memory_report()["weights_bytes"]
    for precision in ("w8", "w4"):
        model.morph.to_precision("all", precision)
        report = model.memory_report()
        assert report["weights_bytes"] < weights_fp, f"{precision}: {report['weights_bytes']} >= {weights_fp}"
        assert len(model.generate(prompt, max_tokens=16, ignore_eos=True).outputs[0].token_ids) == 16
        # Quantized from the bf16 weights, the next-token distribution stays close to the bf16 model's. A tiny
        # random model's logits are flat (its top two differ by ~0.05 nats), so the greedy token itself may
        # flip; two of the three most likely tokens out of 49152 may not.
        quantized_top = top3(model, prompt)
        assert len(set(quantized_top) & set(fp_top)) >= 2, f"{precision}: top-3 {quantized_top}, fp {fp_top}"
    model.morph.to_precision("all", "fp")
    assert_bit_identical(model, original)
    assert model.generate(prompt, max_tokens=16, ignore_eos=True).outputs[0].token_ids == fp_tokens
