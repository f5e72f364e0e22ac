"""The logits processors transformers lacks, in its LogitsProcessor calling convention (input_ids [1, L] = prompt and
output so far, scores [1, V] -> scores), so they sit in one LogitsProcessorList with transformers' own (repetition
penalty, min_p, bad words, min new tokens) and travel to a worker with it. Each keeps only small state: a
multi-worker step pickles the processors of every sampling row."""
from __future__ import annotations

import torch


class OpenAIPenaltiesProcessor:
    """OpenAI's presence and frequency penalties over the output tokens (not the prompt): a token's logit loses
    presence_penalty if the output holds it, plus frequency_penalty per occurrence."""

    def __init__(self, presence_penalty: float, frequency_penalty: float, num_prompt_tokens: int):
        self.presence_penalty = presence_penalty
        self.frequency_penalty = frequency_penalty
        self.num_prompt_tokens = num_prompt_tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[0, self.num_prompt_tokens:]
        if output.numel() == 0:
            return scores
        counts = torch.bincount(output, minlength=scores.shape[-1])[:scores.shape[-1]].to(scores.dtype)   # [V]
        return scores - (self.frequency_penalty * counts + self.presence_penalty * (counts > 0).to(scores.dtype))


class LogitBiasProcessor:
    """OpenAI's logit_bias: a fixed amount added to the logits of chosen tokens (-100 bans, +100 forces)."""

    def __init__(self, bias: dict[int, float]):
        self.token_ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.token_ids] += self.values.to(scores.dtype)
        return scores


class AllowedTokensProcessor:
    """vLLM's allowed_token_ids: every other token gets -inf."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, float("-inf"))
        out[:, self.token_ids] = scores[:, self.token_ids]
        return out
