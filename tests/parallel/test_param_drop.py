"""Parameter dropping (KunServe): two data-parallel instances drop replicated layers into one pipeline group, the
KV of running requests is exchanged between steps (never recomputed), queued requests run meanwhile, and the
layers come back on restore. Exact greedy tokens against HF, the ledger and RSS against the dropped layers' bytes,
failures before the commit point roll back, a member killed mid-exchange is replaced and its requests recomputed."""
import time

import pytest
import torch

from elastic_hf import ElasticModel
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.model.loader import load_hf_model
from elastic_hf.parallel.worker_reshape import RESHAPE_STAGES
from greedy_reference import hf_greedy, mixed_prompts

MAX_NEW = 12
KV = 512 << 10   # per worker: ~24 blocks of this model, so 6 requests per instance overload it


# The vocabulary of the test model: its tables (embedding, head: 256 KiB each) small beside its layers, as a real
# model's are beside its many layers (the default tokenizer's 49,152 rows would be 12 MiB each here, 8x the layers,
# and a pipeline stage that gives its tables back would hold several times the KV whatever the split;
# test_stage_tables.py and test_pipeline.py cover the tables).
VOCAB = 1024


@pytest.fixture(scope="module")
def drop_checkpoint(tmp_path_factory):
    from tiny_models import build_tiny_checkpoint

    # 5 layers with a wide MLP (1.6 MiB per layer fp32): a dropped layer shows in the ledger and in RSS.
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("drop") / "llama", 0, num_hidden_layers=5,
                                 intermediate_size=2048, vocab_size=VOCAB)


class SmallVocab:
    """The default tokenizer with its ids folded into VOCAB: prompts cut from real text stay varied."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text, add_special_tokens=False):
        return [t % VOCAB for t in self.tokenizer.encode(text, add_special_tokens=add_special_tokens)]


@pytest.fixture(scope="module")
def reference(drop_checkpoint):
    model, tokenizer = load_hf_model(drop_checkpoint)
    return model, SmallVocab(tokenizer)


def _model(path, **options):
    # max_num_seqs=4: each instance runs 4 requests and queues the rest (no preemption), so any re-prefill would
    # show in num_computed_prompt_tokens.
    options = {"kv_cache_memory": KV, "max_num_batched_tokens": 48, "max_num_seqs": 4, **options}
    return ElasticModel.from_pretrained(path, workers=2, **options)


class Driver:
    """Steps a deployment and records every request's tokens and whether a first token came while a KV exchange
    was in flight."""

    def __init__(self, dep):
        self.dep = dep
        self.done: dict[str, list[int]] = {}
        self.first_token_during_exchange: set[str] = set()
        self.seen: set[str] = set()
        self.num_outputs = 0

    def step(self, n=1):
        for _ in range(n):
            exchanging = self.dep.overload.exchange is not None
            outputs = self.dep.step()
            self.num_outputs += len(outputs)
            for out in outputs:
                if out.request_id not in self.seen and out.outputs[0].token_ids:
                    self.seen.add(out.request_id)
                    if exchanging:
                        self.first_token_during_exchange.add(out.request_id)
                if out.finished:
                    self.done[out.request_id] = out.outputs[0].token_ids

    def until(self, ids, timeout_s: float = 180.0):
        # by time, not steps: a step while every request waits for the exchange returns at once
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(r in self.done for r in ids):
                return
            self.step()
        raise AssertionError(f"requests {sorted(set(ids) - set(self.done))} did not finish")


def _started(dep, prompts):
    """The prompts added as greedy requests and two steps run: both instances decode, some prompts mid-chunk."""
    run = Driver(dep)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    ids = [dep.add_request(None, p, params) for p in prompts]
    run.step(2)
    return run, ids


def test_drop_restore_drop_keeps_greedy_tokens_without_reprefill(drop_checkpoint, reference):
    ref, tokenizer = reference
    first = mixed_prompts(tokenizer, 12, 8, 60, seed=31)
    second = mixed_prompts(tokenizer, 8, 8, 60, seed=32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    with _model(drop_checkpoint) as model:
        dep = model.deployment
        run = Driver(dep)
        ids = [dep.add_request(None, p, params) for p in first]
        run.step(2)   # 4 running per instance (one still mid-prefill chunk: 48-token steps), 2 queued each
        mid_prefill = [s for i in dep.instances for s in i.engine.scheduler.running
                       if 0 < s.num_computed_tokens < s.num_prompt_tokens]
        assert mid_prefill and sum(len(i.engine.scheduler.waiting) for i in dep.instances) >= 2
        steps_before = dep.stats()["num_steps"]
        report = model.drop()
        assert report is not None and report.committed and str(dep.topology).startswith("[1x2")
        assert dep.stats()["num_steps"] == steps_before   # the retired engines' steps still count
        assert dep.overload.exchange is not None and sum(len(i.engine.scheduler.exchanging) for i in dep.instances)
        run.until(ids[:6])   # some finish (the live KV must fit the undropped instances again), then restore
        assert model.restore() is not None and str(dep.topology) == "[1,1]"
        ids2 = [dep.add_request(None, p, params) for p in second]
        run.step(2)
        assert model.drop() is not None
        run.until(ids + ids2)
        stats = dep.stats()
        assert stats["num_preemptions"] == 0
        # Every prompt token computed exactly once: the drops and the restore moved KV, they recomputed nothing.
        assert dep.num_computed_prompt_tokens == sum(map(len, first + second))
        assert run.first_token_during_exchange, "queued requests must run while the KV is exchanged"
    for rid, prompt in zip(ids + ids2, first + second):
        assert run.done[rid] == hf_greedy(ref, prompt, MAX_NEW), rid


def _nearly_full(dep, prompts):
    """Every prompt admitted and prefilled: the KV of both instances more than 80 % full."""
    run, ids = _started(dep, prompts)
    while any(i.engine.scheduler.waiting for i in dep.instances) or any(
            s.num_computed_tokens < s.num_prompt_tokens for i in dep.instances for s in i.engine.scheduler.running):
        run.step()
    used = [i.engine.scheduler.kv.num_used for i in dep.instances]
    assert min(u / i.engine.scheduler.kv.num_total for u, i in zip(used, dep.instances)) > 0.8, used
    return run, ids, used


FULL_KV = {"kv_cache_memory": 16 << 20, "max_num_seqs": 16, "max_num_batched_tokens": 1024}


def test_a_drop_whose_layout_holds_less_preempts_the_youngest_instead_of_being_refused(drop_checkpoint, reference):
    """A split that puts 4 of 5 layers on the first stage cannot hold 4/5 of every request's KV there with the KV
    ~90 % full: the drop used to be refused, leaving every queued request waiting. With preemption allowed (the
    arbiter's drops) the youngest running requests go over without their KV (recomputed), the rest are exchanged;
    every request still ends with HF's greedy tokens."""
    from elastic_hf.parallel.reshape import run_reshape

    ref, tokenizer = reference
    prompts = mixed_prompts(tokenizer, 26, 880, 960, seed=41)
    with _model(drop_checkpoint, **FULL_KV) as model:
        dep = model.deployment
        run, ids, _ = _nearly_full(dep, prompts)
        with pytest.raises(ValueError, match="no new instance has that many free"):
            run_reshape(dep, "1x2:4/1", defer_kv=True)
        report = run_reshape(dep, "1x2:4/1", defer_kv=True, allow_preemption=True)
        assert report.committed and 0 < len(report.preempted) <= len(prompts) // 2, report.preempted
        run.until(ids)
    preempted = set(report.preempted)
    checked = [(rid, p) for rid, p in zip(ids, prompts) if rid in preempted][:3] + list(zip(ids, prompts))[:2]
    for rid, prompt in checked:
        assert run.done[rid] == hf_greedy(ref, prompt, MAX_NEW), rid


def test_a_drop_into_a_nearly_full_kv_exchanges_in_chunks_what_both_pools_at_once_could_not(drop_checkpoint,
                                                                                              reference):
    """KunServe §4.2's in-place exchange, in committed pages: the new pool's blocks are committed chunk by chunk as
    the old pool gives its pages back, so a member never holds both pools whole. With the KV ~85 % full the two
    pools together exceed every member's budget (the old exchange refused this plan, or preempted half of the
    requests). The arbiter's drop splits for the most KV (3/2: the head-balanced 4/1 holds less than the demand),
    every running request is exchanged, nothing is recomputed, and the tokens are HF's."""
    ref, tokenizer = reference
    prompts = mixed_prompts(tokenizer, 26, 880, 960, seed=41)
    with _model(drop_checkpoint, **FULL_KV) as model:
        dep = model.deployment
        run, ids, used = _nearly_full(dep, prompts)
        before = dep.memory_report()
        report = model.drop()
        assert report is not None and report.committed and not report.preempted
        assert str(dep.topology) == "[1x2:3/2]"
        after = dep.memory_report()
        for w, (b, a) in enumerate(zip(before, after)):
            both_pools = sum(used) * a["kv_block_bytes"] + used[w] * b["kv_block_bytes"]
            assert both_pools > a["budget_bytes"] - a["weights_bytes"], (w, both_pools, a)
        run.until(ids)
        assert dep.stats()["num_preemptions"] == 0
        assert dep.num_computed_prompt_tokens == sum(map(len, prompts))   # every request's KV moved, none recomputed
    for rid, prompt in list(zip(ids, prompts))[::6]:
        assert run.done[rid] == hf_greedy(ref, prompt, MAX_NEW), rid


@pytest.mark.outer_only   # the drop path of the first test, measured
def test_drop_frees_the_layers_bytes_for_kv_blocks(drop_checkpoint, reference):
    ref, tokenizer = reference
    # What a stage places in its weights arena per layer: the linears (the norms' few hundred bytes stay put).
    per_layer = [sum(m.weight.numel() * m.weight.element_size() for m in layer.modules()
                     if isinstance(m, torch.nn.Linear)) for layer in ref.model.layers]
    prompts = mixed_prompts(tokenizer, 10, 8, 40, seed=33)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    with _model(drop_checkpoint) as model:
        dep = model.deployment
        run = Driver(dep)
        ids = [dep.add_request(None, p, params) for p in prompts]
        run.step(2)
        before = model.memory_report()["workers"]
        blocks_before = sum(i.engine.scheduler.kv.num_total for i in dep.instances)
        report = model.drop()
        assert report is not None
        # At the commit point (the old pools still hold live KV), before the exchange writes into the new pools
        after = report.committed_memory
        page = dep.pool.call(0, "info")["page_size"]
        for w, (b, a) in enumerate(zip(before, after)):
            start, end = a["layers"]
            # the layers a stage stops holding, and the vocabulary tables it stops reading (stage_tables.py)
            dropped = sum(n for i, n in enumerate(per_layer) if not start <= i < end) \
                + b["table_bytes"] - a["table_bytes"]
            # The ledger drops by the dropped layers' bytes (each tensor padded to at most one page).
            assert 0 <= (b["weights_bytes"] - a["weights_bytes"]) - dropped <= 9 * page * (5 - (end - start)), w
            # RSS: at least 80 % of the dropped bytes went back to the OS at once.
            assert b["rss_anon_bytes"] - a["rss_anon_bytes"] >= 0.8 * dropped, (w, b["rss_anon_bytes"],
                                                                                 a["rss_anon_bytes"], dropped)
        run.until(ids)
        # After the exchange the old pools are gone: every byte a stage does not spend on weights is KV blocks.
        final = model.memory_report()["workers"]
        group = dep.instances[0]
        assert group.engine.scheduler.kv.num_total == dep.capacity(group.key) > blocks_before
        limiting = min(final, key=lambda r: r["kv_blocks"])
        spare = limiting["budget_bytes"] - limiting["weights_bytes"] - limiting["kv_bytes"]
        assert spare < limiting["kv_block_bytes"], limiting
    for rid, prompt in zip(ids, prompts):
        assert run.done[rid] == hf_greedy(ref, prompt, MAX_NEW), rid


def test_history_logs_an_idle_drop_before_its_exchange(drop_checkpoint):
    """With no request running, the exchange the commit starts has nothing to move and settles inside the commit;
    the history still reads in commit order: the drop, then its exchange, then the restore."""
    with _model(drop_checkpoint) as model:
        assert model.drop() is not None
        assert model.restore() is not None
        events = [h["event"] for h in model.overload_state()["history"]]
        assert events[:2] == ["drop", "exchange_done"] and events[-1] == "restore", events


@pytest.mark.stress
def test_failed_drop_rolls_back_at_every_stage_and_serves_on(drop_checkpoint, reference):
    ref, tokenizer = reference
    prompts = mixed_prompts(tokenizer, 10, 8, 40, seed=34)
    with _model(drop_checkpoint) as model:
        dep = model.deployment
        run, ids = _started(dep, prompts)
        weights = [r["weights_bytes"] for r in model.memory_report()["workers"]]
        for stage in RESHAPE_STAGES:   # a failure at each step before the commit point
            dep.pool.call(1, "reshape.arm_fault", stage)
            assert model.drop() is None, stage
            assert str(dep.topology) == "[1,1]" and dep.overload.exchange is None, stage
            assert model.overload_state()["history"][-1]["outcome"] == "rolled_back", stage
            assert [r["weights_bytes"] for r in model.memory_report()["workers"]] == weights, stage
            run.step()   # the old instances serve on between the attempts
        assert model.drop() is not None   # and a drop still works afterwards
        run.until(ids)
        assert dep.stats()["num_preemptions"] == 0
    for rid, prompt in zip(ids, prompts):
        assert run.done[rid] == hf_greedy(ref, prompt, MAX_NEW), rid


def test_restore_loads_the_layers_beside_the_steps_then_commits(drop_checkpoint, reference):
    """The arbiter's restore after a drop: free KV blocks make room, every worker loads its missing layers and then
    copies the running requests' full KV blocks while the pipeline serves on, and the reshape that commits finds
    both in place (it loads nothing itself and moves only the blocks written since the copy). A second drop after
    it exchanges the KV again; greedy tokens equal HF's across drop -> restore -> drop, nothing re-prefilled."""
    ref, tokenizer = reference
    prompts = mixed_prompts(tokenizer, 6, 8, 40, seed=37)
    with _model(drop_checkpoint, kv_cache_memory=2 * KV) as model:   # room for the layers and the KV copy
        dep = model.deployment
        control = dep.overload
        run, ids = _started(dep, prompts)
        assert model.drop() is not None
        dep.settle_exchange()
        run.step(2)
        assert control.begin_restore() and control.prewarm is not None
        given = control.prewarm.summary()["prewarm_kv_blocks_given"]
        assert given > 0 and str(dep.topology).startswith("[1x2")   # the pipeline serves while the layers load
        outputs_before = run.num_outputs
        while control.prewarm is not None:
            run.step()
        assert run.num_outputs > outputs_before and str(dep.topology) == "[1,1]"
        entry = [h for h in control.history if h["event"] == "restore"][-1]
        assert entry["outcome"] == "committed" and entry["prewarm_kv_blocks_given"] >= given
        stats = dep.reshapes[-1].worker_stats
        assert all(s["prewarmed"]["bytes"] > 0 and s["preload"]["bytes"] == 0 for s in stats), stats
        # The running requests' full blocks were copied beside the steps: the commit moved only what was written
        # since (restore_precopy.py): a sequence's partial last block and at most one it filled after the copy.
        block_bytes = dep.pool.call(0, "info")["kv_block_bytes_tp1"]
        moved = sum(dep.reshapes[-1].kv_plan_bytes.values())
        assert entry["precopy_blocks"] > 0, entry
        assert moved <= 2 * dep.reshapes[-1].num_moved_seqs * block_bytes, (entry, moved, block_bytes)
        # drop -> overlapped restore -> drop: the second drop exchanges the KV beside the steps again.
        second = mixed_prompts(tokenizer, 4, 8, 40, seed=39)
        ids2 = [dep.add_request(None, p, SamplingParams(temperature=0.0, max_tokens=MAX_NEW)) for p in second]
        run.step(2)
        assert model.drop() is not None and str(dep.topology).startswith("[1x2")
        assert sum(len(i.engine.scheduler.exchanging) for i in dep.instances), "the second drop moved no KV"
        run.until(ids + ids2)
        assert dep.stats()["num_preemptions"] == 0
        # Every prompt token computed once: the drops and the restore moved KV, they recomputed nothing.
        assert dep.num_computed_prompt_tokens == sum(map(len, prompts + second))
    for rid, prompt in zip(ids + ids2, prompts + second):
        assert run.done[rid] == hf_greedy(ref, prompt, MAX_NEW), rid


def test_a_restore_kv_copy_cancelled_or_cut_short_loses_nothing(drop_checkpoint, reference):
    """A KV pre-copy that another reshape cancels gives its pool and the blocks it took back (the pipeline serves
    on, exact); an operator's restore while a second copy is still running waits for it and moves only the rest."""
    ref, tokenizer = reference
    prompts = mixed_prompts(tokenizer, 6, 24, 40, seed=38)
    with _model(drop_checkpoint, kv_cache_memory=2 * KV, overload={"exchange_cpu_share": 0.05}) as model:
        dep = model.deployment
        control = dep.overload
        run, ids = _started(dep, prompts)
        assert model.drop() is not None
        dep.settle_exchange()
        total = [i.engine.scheduler.kv.num_total for i in dep.instances]
        kv_bytes = [r["kv_bytes"] for r in model.memory_report()["workers"]]

        def copying():
            assert control.begin_restore()
            for _ in range(50):
                if control.prewarm.precopy is not None:
                    return
                run.step()
            raise AssertionError("the KV pre-copy did not start")

        copying()
        control.prewarm.cancel()   # what another reshape does first
        control.prewarm = None
        assert [i.engine.scheduler.kv.num_total for i in dep.instances] == total
        assert [r["kv_bytes"] for r in model.memory_report()["workers"]] == kv_bytes   # the copy's pool is gone
        run.step(2)
        copying()
        report = model.restore()   # the operator's, mid-copy: the copy is finished first, then the rest moves
        assert report is not None and str(dep.topology) == "[1,1]"
        entry = [h for h in control.history if h["event"] == "restore"][-1]
        assert entry["precopy_blocks"] > 0, entry
        run.until(ids)
        assert dep.stats()["num_preemptions"] == 0
    for rid, prompt in zip(ids, prompts):
        assert run.done[rid] == hf_greedy(ref, prompt, MAX_NEW), rid


@pytest.mark.stress
def test_member_killed_mid_exchange_is_restored_from_host_store(drop_checkpoint, reference):
    ref, tokenizer = reference
    prompts = mixed_prompts(tokenizer, 10, 8, 40, seed=35)
    with _model(drop_checkpoint) as model:
        dep = model.deployment
        run, ids = _started(dep, prompts)
        dep.pool.call(1, "exchange.arm_fault", 1)   # dies in the second chunk of the exchange
        assert model.drop() is not None
        run.until(ids)   # nothing lost: the parked requests are recomputed on the replaced group
        assert dep.num_recoveries == 1 and str(dep.topology).startswith("[1x2")
        layers = [r["layers"] for r in model.memory_report()["workers"]]
        assert layers[0][1] == layers[1][0] and layers[1][1] == 5   # the new process loaded its stage's layers
    for rid, prompt in zip(ids, prompts):
        assert run.done[rid] == hf_greedy(ref, prompt, MAX_NEW), rid


@pytest.mark.outer_only   # the drop path of the first test, started by the arbiter
def test_overload_mode_drop_acts_and_restores_on_its_own(drop_checkpoint, reference):
    ref, tokenizer = reference
    prompts = mixed_prompts(tokenizer, 20, 30, 90, seed=36)   # ~2x what the two instances hold
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    overload = {"mode": "drop", "hold_steps": 1, "restore_hold_steps": 3, "cooldown_steps": 4,
                "exchange_cpu_share_queued": 1.0}
    with _model(drop_checkpoint, overload=overload) as model:
        dep = model.deployment
        run = Driver(dep)
        ids = [dep.add_request(None, p, params) for p in prompts]
        run.until(ids)
        for _ in range(8):   # idle steps: the low load holds, the layers come back
            run.step()
        events = [(h["event"], h["outcome"]) for h in model.overload_state()["history"]
                  if h["event"] != "exchange_done"]
        assert events == [("drop", "committed"), ("restore", "committed")], events
        # ~2x what the instances hold: requests queued behind the exchange, whose CPU cap was lifted meanwhile
        # (exchange_cpu_share_queued)
        exchange = [h for h in model.overload_state()["history"] if h["event"] == "exchange_done"][0]
        assert 0 < exchange["queued_boundaries"] <= exchange["step_boundaries"], exchange
        assert exchange["max_cpu_share"] == 1.0, exchange   # the steps carried the lifted cap to the workers
        assert str(dep.topology) == "[1,1]"
        metrics = dep.metrics.registry.get_sample_value
        assert metrics("elastic_hf_param_drops_total", {"outcome": "committed"}) == 1
        assert metrics("elastic_hf_kv_exchange_bytes_total") > 0
    for rid, prompt in zip(ids, prompts):
        assert run.done[rid] == hf_greedy(ref, prompt, MAX_NEW), rid


def test_a_tied_table_goes_with_the_drop_and_comes_back_with_the_restore(tmp_path_factory):
    """A tied model (the default model ties its 108 MiB table): the drop's first stage gives the one table back and
    embeds from the host store's rows, the last stage keeps it as its head, the restore refills it into the packed
    layout; the ledger moves by the table and the tokens are HF's across drop -> restore -> drop."""
    from tiny_models import build_tiny_checkpoint

    path = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("drop-tied") / "llama", 0, num_hidden_layers=4,
                                 intermediate_size=512, tie_word_embeddings=True)
    ref, tokenizer = load_hf_model(path)
    table = 49152 * 64 * 4   # [vocab, hidden] fp32
    prompts = mixed_prompts(tokenizer, 8, 8, 40, seed=51)
    with _model(path, kv_cache_memory=2 * KV) as model:
        dep = model.deployment
        base = model.memory_report()["workers"]
        assert [w["table_bytes"] for w in base] == [table, table]
        run, ids = _started(dep, prompts)
        assert model.drop() is not None
        dropped = model.memory_report()["workers"]
        assert [w["table_bytes"] for w in dropped] == [0, table]
        assert [w["host_embedding_rows"] for w in dropped] == [True, False]
        held = dropped[0]["layers"][1]
        assert base[0]["weights_bytes"] - dropped[0]["weights_bytes"] > table + (4 - held) * 64 * 512 * 3 * 4
        run.step(3)
        assert model.restore() is not None
        restored = model.memory_report()["workers"]
        assert [w["table_bytes"] for w in restored] == [table, table] and not restored[0]["host_embedding_rows"]
        assert [w["weights_bytes"] for w in restored] == [w["weights_bytes"] for w in base]
        run.step(2)
        assert model.drop() is not None
        run.until(ids)
        assert dep.num_computed_prompt_tokens == sum(map(len, prompts))   # moved, never recomputed
    for rid, prompt in zip(ids, prompts):
        assert run.done[rid] == hf_greedy(ref, prompt, MAX_NEW), rid
