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


class TopKTopPProcessor:
    """HF's TopKLogitsWarper then TopPLogitsWarper in one pass: keep the top_k best tokens (0: all), then of those
    the fewest whose probability (renormalised over the kept ones) reaches top_p (every token whose better-ranked
    tokens hold less than top_p). HF's top-p sorts the whole vocabulary (~1.5 ms a row at 49k tokens on the 2-core
    test machine); the nucleus nearly always lies among the best few hundred tokens, so this sorts only those and
    falls back to the full sort when their mass is short of top_p, with the same result."""

    CANDIDATES = 256

    def __init__(self, top_k: int, top_p: float):
        self.top_k = top_k
        self.top_p = top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        k = min(self.top_k, vocab) if self.top_k > 0 else vocab
        candidates = min(k, self.CANDIDATES) if self.top_p < 1 else k
        values, indices = scores[0].topk(candidates)                                  # [n], descending
        keep = candidates
        if self.top_p < 1:
            # the kept distribution's normaliser: over the top_k tokens, or over the whole vocabulary
            kept = scores[0] if k == vocab else values if k == candidates else scores[0].topk(k).values
            normaliser = torch.logsumexp(kept, 0)
            mass = (values - normaliser).exp().to(torch.float64).cumsum(0)                   # [n]
            while mass[-1] < self.top_p and candidates < k:   # the nucleus reaches beyond the candidates
                candidates = min(k, candidates * 16)
                values, indices = scores[0].topk(candidates)
                mass = (values - normaliser).exp().to(torch.float64).cumsum(0)
            # token r stays when the tokens ranked before it hold less than top_p
            keep = 1 + int((mass[:-1] < self.top_p).sum())
        out = torch.full_like(scores, float("-inf"))
        out[0, indices[:keep]] = scores[0, indices[:keep]]
        return out
