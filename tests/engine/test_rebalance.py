"""Queue rebalancing as data (engine/rebalance.py): which unstarted requests move between instances' queues."""
from elastic_hf.engine.rebalance import InstanceQueue, QueuedRequest, imbalanced, plan_moves

BUDGET = 512


def _queue(index, decode_rows=0, prefill_tokens=0, free_blocks=1000, total_blocks=1000, workers=1):
    return InstanceQueue(index, workers, BUDGET, decode_rows, prefill_tokens, free_blocks, total_blocks)


def _waiting(instance, orders, tokens=500, blocks=40, **kw):
    return [QueuedRequest(f"r{o}", instance, o, tokens, blocks, **kw) for o in orders]


def test_a_backlog_behind_one_instance_is_shared_with_an_idle_one_oldest_first():
    # Instance 0 holds six 500-token prompts (~1 step each); instance 1 idles. The first one stays where it is;
    # list scheduling alternates the rest, so each queue keeps its requests in admission order.
    moves = plan_moves([_queue(0), _queue(1)], _waiting(0, range(6)))
    assert [m.request_id for m in moves] == ["r1", "r3", "r5"]
    assert all(m.source == 0 and m.target == 1 and m.gain_steps > 0.5 for m in moves)


def test_nothing_moves_for_less_than_half_a_step():
    # The second 200-token request would be done ~0.4 steps later where it is than on the idle instance.
    assert plan_moves([_queue(0), _queue(1)], _waiting(0, range(2), tokens=200)) == []
    assert [m.request_id for m in plan_moves([_queue(0), _queue(1)], _waiting(0, range(2), tokens=400))] == ["r1"]
    # Balanced queues stay as they are.
    assert plan_moves([_queue(0), _queue(1)], _waiting(0, [0, 2]) + _waiting(1, [1, 3])) == []


def test_a_target_must_hold_the_whole_request_beside_those_placed_there():
    queues = [_queue(0), _queue(1, free_blocks=50)]
    moves = plan_moves(queues, _waiting(0, range(6)))
    assert [m.request_id for m in moves] == ["r1"]   # 40 of its 50 free blocks: the next one does not fit
    assert plan_moves([_queue(0), _queue(1, total_blocks=30, free_blocks=30)], _waiting(0, range(6))) == []


def test_unmovable_requests_stay_and_still_count_in_their_queue():
    # Three pinned requests are ahead on instance 0: every movable one behind them is done sooner on instance 1.
    moves = plan_moves([_queue(0), _queue(1)], _waiting(0, range(3), movable=False) + _waiting(0, range(3, 6)))
    assert [m.request_id for m in moves] == ["r3", "r4", "r5"]


def test_decoding_rows_and_running_prefills_slow_an_instance_down():
    # Instance 1 is not idle: 480 decoding rows leave it 32 tokens a step (clamped to a quarter of the budget).
    busy = _queue(1, decode_rows=480)
    assert busy.drain_rate() == BUDGET * 0.25
    assert plan_moves([_queue(0), busy], _waiting(0, range(3))) == []
    # A long prefill still running on instance 1 counts as work ahead of anything moved there.
    assert plan_moves([_queue(0), _queue(1, prefill_tokens=5000)], _waiting(0, range(4))) == []


def test_an_instance_of_more_workers_drains_its_backlog_faster():
    # 2,000 prompt tokens still running: ~4 steps of one worker, ~2 of two.
    assert plan_moves([_queue(0), _queue(1, prefill_tokens=2000)], _waiting(0, range(4))) == []
    moves = plan_moves([_queue(0), _queue(1, prefill_tokens=2000, workers=2)], _waiting(0, range(4)))
    assert [(m.request_id, m.target) for m in moves] == [("r3", 1)]


def test_a_cached_prefix_keeps_a_request_home_unless_the_backlog_outweighs_it():
    cached = {0: 480}   # instance 0 caches 480 of the request's 500 tokens
    first = _waiting(0, [0], tokens=600)
    assert plan_moves([_queue(0), _queue(1)], first + _waiting(0, [1])) != []          # uncached: it moves
    assert plan_moves([_queue(0), _queue(1)], first + _waiting(0, [1], cached_tokens=cached)) == []
    backlog = _waiting(0, range(6), tokens=600, movable=False)
    moves = plan_moves([_queue(0), _queue(1)], backlog + _waiting(0, [6], cached_tokens=cached))
    assert [m.request_id for m in moves] == ["r6"]


def test_at_most_max_moves_a_step():
    assert len(plan_moves([_queue(0), _queue(1)], _waiting(0, range(40)), max_moves=4)) == 4


def test_balanced_queues_skip_the_plan():
    assert not imbalanced([_queue(0), _queue(1)], _waiting(0, [0, 2]) + _waiting(1, [1, 3]))
    assert imbalanced([_queue(0), _queue(1)], _waiting(0, range(3)))
    # Work still running counts: instance 1's long prefill balances instance 0's queue.
    assert not imbalanced([_queue(0), _queue(1, prefill_tokens=1500)], _waiting(0, range(3)))
