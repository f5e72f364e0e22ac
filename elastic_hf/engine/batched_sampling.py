"""Sampling of many rows at once: temperature, top-k and top-p as HF's warpers define them (see
logits_processors.TopKTopPProcessor for the top-p rule), then one draw per row from its own seeded generator.
Per row these cost ~1 ms at a 49k vocabulary on the 2-core test machine (a full sort for top-p, a softmax, a draw):
a third of a batch-64 decode step. Here the rows share one top-k over a few hundred candidates, one logsumexp and
one cumsum; a row whose nucleus reaches beyond the candidates, or whose top_k does, takes the exact per-row path."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic_hf.engine.logits_processors import TopKTopPProcessor

CANDIDATES = 256


@dataclass(frozen=True, slots=True)
class Warp:
    """A sampled row's warpers: temperature (> 0), top_k (0: all), top_p (1: all)."""
    temperature: float
    top_k: int
    top_p: float


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [V] by inverting its CDF with one uniform number of `generator`. torch.multinomial
    takes 1.3 ms for a 49k vocabulary on the 2-core test machine (its CPU path draws per element); a float64 cumsum
    and a binary search take ~0.1 ms. A token of probability 0 (masked by a grammar, cut by top-k/top-p) is never
    drawn: its CDF step is empty. RuntimeError for NaN or infinite probabilities."""
    return draw_from_cdf(probs.to(torch.float64).cumsum(0), generator)


def draw_from_cdf(cdf: torch.Tensor, generator: torch.Generator) -> int:
    """cdf [n]: the cumulative (unnormalised, float64) weights; the index drawn."""
    total = float(cdf[-1])
    if not total > 0 or total == float("inf"):   # NaN logits (a broken model or input) fail this row alone
        raise RuntimeError(f"cannot sample from probabilities that sum to {total} (NaN or infinite logits)")
    u = torch.rand(1, dtype=torch.float64, generator=generator) * total
    index = min(int(torch.searchsorted(cdf, u, right=True)), cdf.shape[0] - 1)
    while index > 0 and cdf[index] == cdf[index - 1]:   # u rounded up to the total: the last token with weight
        index -= 1
    return index


def sample_warped(scores: torch.Tensor, warps: list[Warp],
                  generators: list[torch.Generator]) -> list[int | Exception]:
    """scores [n, V] (processed logits of n sampled rows); per row its token id, or the exception that failed it."""
    scores = scores / torch.tensor([w.temperature for w in warps], dtype=scores.dtype).unsqueeze(1)   # [n, V]
    vocab = scores.shape[1]
    out: list[int | Exception] = [0] * len(warps)
    cut = [r for r, w in enumerate(warps) if 0 < w.top_k < vocab or w.top_p < 1]
    whole = sorted(set(range(len(warps))) - set(cut))   # nothing cut: the whole distribution
    if whole:
        cdfs = torch.softmax(scores[whole], dim=1).to(torch.float64).cumsum(1)          # [w, V]
        for i, r in enumerate(whole):
            out[r] = _guarded(lambda: draw_from_cdf(cdfs[i], generators[r]))
    if not cut:
        return out
    width = min(vocab, max(min(warps[r].top_k or vocab, CANDIDATES) for r in cut))
    values, indices = scores[cut].topk(width, dim=1)                                  # [c, width], descending
    full_norm = torch.logsumexp(scores[cut], dim=1)                                   # [c]
    for i, r in enumerate(cut):
        warp = warps[r]
        k = min(warp.top_k, vocab) if warp.top_k > 0 else vocab
        if k > width and (warp.top_p >= 1 or k < vocab):   # a top-k beyond the candidates: the exact path
            out[r] = _per_row(scores[r], warp, generators[r])
            continue
        keep = min(k, width)
        if warp.top_p < 1:
            norm = full_norm[i] if k == vocab else torch.logsumexp(values[i, :keep], 0)
            mass = (values[i, :keep] - norm).exp().to(torch.float64).cumsum(0)              # [keep]
            if mass[-1] < warp.top_p and keep < k:   # the nucleus reaches beyond the candidates
                out[r] = _per_row(scores[r], warp, generators[r])
                continue
            keep = 1 + int((mass[:-1] < warp.top_p).sum())
        weights = (values[i, :keep] - values[i, 0]).exp().to(torch.float64)             # [keep]
        out[r] = _guarded(lambda: int(indices[i, draw_from_cdf(weights.cumsum(0), generators[r])]))
    return out


def _per_row(scores: torch.Tensor, warp: Warp, generator: torch.Generator) -> int | Exception:
    cut = TopKTopPProcessor(warp.top_k, warp.top_p)(None, scores.unsqueeze(0))[0]
    return _guarded(lambda: draw(torch.softmax(cut, 0), generator))


def _guarded(fn) -> int | Exception:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - one row's failure fails its request alone
        return exc
