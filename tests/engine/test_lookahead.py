"""Lookahead micro-batch formulation (KunServe §4.3, Fig. 11): balanced predicted costs on a burst, MIN respected,
the stream order kept (pieces of a request in order, concatenation = the step), decodes never cut, and the cost
model beating token counts where attention makes equal-token micro-batches unequal."""
from __future__ import annotations

import random

import pytest

from elastic_hf.engine.cost_model import CostModel
from elastic_hf.engine.lookahead import (Piece, WorkItem, balance, cost_chosen_split, lookahead_split,
                                         pipeline_time, predicted_costs, token_count_split)

# About SmolLM2-135M fp32 on a 2-core CPU as `elastic-hf profile-cost` fits it (seconds).
MODEL = CostModel(alpha=8e-7, beta=1.2e-3, gamma=6e-2, lam=5.5e-2, head=2e-3, num_layers=30, min_tokens=48)


def _burst(seed: int, num_prompts: int = 24) -> list[WorkItem]:
    """A queue after a burst: fresh prompt chunks, later chunks of long prompts (prefix > 0) and decodes."""
    rng = random.Random(seed)
    items = []
    for _ in range(num_prompts):
        kind = rng.random()
        if kind < 0.3:
            items.append(WorkItem(rng.randint(20, 600), 1, True))
        elif kind < 0.6:
            items.append(WorkItem(rng.randint(64, 1500), rng.randint(16, 256), rng.random() < 0.5))
        else:
            items.append(WorkItem(0, rng.randint(16, 400), True))
    return items


def _check_stream(items: list[WorkItem], micro_batches: list[list[Piece]]) -> None:
    """Concatenated pieces are the stream: every item's tokens once, in order, no gap or overlap."""
    flat = [p for mb in micro_batches for p in mb]
    expected_item, expected_start = 0, 0
    for piece in flat:
        if piece.start == 0:
            assert expected_start == 0 or expected_start == items[expected_item].tokens
            if expected_start == items[expected_item].tokens:
                expected_item, expected_start = expected_item + 1, 0
        assert (piece.item, piece.start) == (expected_item, expected_start), flat
        assert piece.end > piece.start
        expected_start = piece.end
    assert expected_item == len(items) - 1 and expected_start == items[-1].tokens


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_burst_micro_batches_are_balanced_ordered_and_never_below_min(seed, num_stages):
    items = _burst(seed)
    micro_batches = lookahead_split(items, MODEL, num_stages)
    assert len(micro_batches) == num_stages
    _check_stream(items, micro_batches)
    assert balance(predicted_costs(micro_batches, items, MODEL)) <= 1.1
    assert balance(predicted_costs(micro_batches, items, MODEL)) <= balance(
        predicted_costs(token_count_split(items, num_stages), items, MODEL))
    for mb in micro_batches:
        assert sum(p.end - p.start for p in mb) >= MODEL.min_tokens
    for piece in (p for mb in micro_batches for p in mb):
        if items[piece.item].tokens == 1:
            assert (piece.start, piece.end) == (0, 1)   # a decode is never cut


def test_all_decodes_cut_only_between_requests():
    items = [WorkItem(100 + 30 * i, 1, True) for i in range(120)]   # 120 tokens: room for 2 x MIN
    micro_batches = lookahead_split(items, MODEL, 2)
    _check_stream(items, micro_batches)
    assert len(micro_batches) == 2 and all(p.end - p.start == 1 for mb in micro_batches for p in mb)
    # The later decodes attend over longer contexts: the first micro-batch takes more of them.
    assert len(micro_batches[0]) > len(micro_batches[1])


def test_min_tokens_limits_the_count_and_a_small_step_stays_whole():
    assert lookahead_split([WorkItem(0, 50, True)], MODEL, 2, min_tokens=32) == [[Piece(0, 0, 50)]]
    assert lookahead_split([WorkItem(0, 1, True)] * 3, MODEL, 4, min_tokens=32) == [
        [Piece(0, 0, 1), Piece(1, 0, 1), Piece(2, 0, 1)]]
    micro_batches = lookahead_split([WorkItem(0, 100, True)], MODEL, 4, min_tokens=32)
    assert len(micro_batches) == 3 and min(p.end - p.start for mb in micro_batches for p in mb) >= 32
    assert lookahead_split([], MODEL, 2) == []


def test_a_long_prefix_chunk_is_balanced_by_cost_not_tokens():
    # One 512-token chunk late in a 4k-token prompt, then fresh prompts with the same token count: the chunk's
    # prefix attention makes the first half of the stream far costlier than the second.
    items = [WorkItem(4096, 512, True)] + [WorkItem(0, 64, True)] * 8
    by_tokens = token_count_split(items, 2)
    assert [sum(p.end - p.start for p in mb) for mb in by_tokens] == [512, 512]
    by_cost = lookahead_split(items, MODEL, 2)
    _check_stream(items, by_cost)
    token_balance = balance(predicted_costs(by_tokens, items, MODEL))
    cost_balance = balance(predicted_costs(by_cost, items, MODEL))
    assert token_balance > 1.5 and cost_balance < 1.1
    # The long chunk is cut: its second piece (longer prefix) goes with the fresh prompts.
    assert by_cost[0] == [Piece(0, 0, by_cost[1][0].start)] and by_cost[1][0].item == 0


def test_a_later_piece_of_a_prompt_costs_more_than_an_earlier_one_of_equal_length():
    items = [WorkItem(0, 1000, True)]
    first, second = predicted_costs([[Piece(0, 0, 500)], [Piece(0, 500, 1000)]], items, MODEL)
    assert second > first
    micro_batches = lookahead_split(items, MODEL, 2)
    assert micro_batches[0][0].end > 500   # so the balanced cut gives the first piece more tokens


def test_token_count_split_is_equal_tokens_and_validates():
    items = [WorkItem(0, 10, True), WorkItem(5, 1, True), WorkItem(0, 9, False)]
    micro_batches = token_count_split(items, 2)
    assert micro_batches == [[Piece(0, 0, 10)], [Piece(1, 0, 1), Piece(2, 0, 9)]]
    assert token_count_split([WorkItem(0, 1, True)], 4) == [[Piece(0, 0, 1)]]
    with pytest.raises(ValueError, match="item 1 needs tokens >= 1"):
        lookahead_split([WorkItem(0, 3, True), WorkItem(0, 0, True)], MODEL, 2)
    with pytest.raises(ValueError, match="num_stages must be >= 1, got 0"):
        lookahead_split(items, MODEL, 0)
    assert balance([2.0, 1.0]) == 2.0 and balance([]) == 1.0


def test_the_cost_model_chooses_the_micro_batch_count():
    """Fewer micro-batches where the fixed costs (the weight stream) dominate, more where token work does: a small
    decode step stays whole, a large one and a burst of prompts are cut, and the chosen count predicts no worse
    than num_stages micro-batches."""
    def predicted(split, items):
        return pipeline_time(predicted_costs(split, items, MODEL), 2)

    small = [WorkItem(200, 1, True)] * 8
    assert len(cost_chosen_split(small, MODEL, 2)) == 1
    large = [WorkItem(200, 1, True)] * 256   # 256 rows through the LM head and the layers: work >> fixed cost
    assert len(cost_chosen_split(large, MODEL, 2)) >= 2
    for seed in range(3):
        items = _burst(seed)
        chosen = cost_chosen_split(items, MODEL, 2)
        _check_stream(items, chosen)
        assert len(chosen) >= 2
        assert predicted(chosen, items) <= predicted(lookahead_split(items, MODEL, 2), items) * (1 + 1e-9)
    assert cost_chosen_split([], MODEL, 2) == []
