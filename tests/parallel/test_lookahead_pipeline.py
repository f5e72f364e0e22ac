"""Lookahead micro-batches on a real 1x2 pipeline (two worker processes): with a cost model set on the instance's
runner, steps are cut by cost, chunks of a prompt land in consecutive micro-batches, and the tokens are exactly HF
greedy's (so the logits come back in the inputs' order and a later piece attends over the KV its earlier piece
wrote on every stage)."""
import pytest

from elastic_hf import ElasticModel
from elastic_hf.engine.cost_model import CostModel
from elastic_hf.model.loader import load_hf_model
from elastic_hf.parallel import instance_runner
from greedy_reference import hf_greedy, mixed_prompts

MAX_NEW = 10
# Hand-made, shaped like a profiled one; MIN 4 so that 48-token steps really are cut.
COST = CostModel(alpha=2e-6, beta=1e-4, gamma=1e-3, lam=5e-4, head=2e-3, num_layers=5, min_tokens=4)


@pytest.fixture(scope="module")
def pp_checkpoint(tmp_path_factory):
    from tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("lookahead-models") / "llama", 0,
                                 num_hidden_layers=5)


def test_lookahead_pipeline_matches_hf_greedy_and_really_splits(pp_checkpoint, monkeypatch):
    reference, tokenizer = load_hf_model(pp_checkpoint)
    prompts = mixed_prompts(tokenizer, 6, 3, 120, seed=31)
    alone = mixed_prompts(tokenizer, 1, 150, 150, seed=32)   # its chunks fill steps alone: a piece without rows
    calls = []   # (inputs, micro_batches) of every lookahead step

    def recording(inputs, shape, model):
        micro_batches = real(inputs, shape, model)
        calls.append((inputs, micro_batches))
        return micro_batches

    real = instance_runner.lookahead_micro_batches
    monkeypatch.setattr(instance_runner, "lookahead_micro_batches", recording)
    with ElasticModel.from_pretrained(pp_checkpoint, workers=2, topology="1x2", kv_cache_memory=4 << 20,
                                      max_num_batched_tokens=48) as model:
        runner = model.deployment.instances[0].runner
        runner.lookahead = COST
        outputs = model.generate(prompts, max_tokens=MAX_NEW) + model.generate(alone, max_tokens=MAX_NEW)
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, MAX_NEW)
                                                             for p in prompts + alone]
        # The prediction was compared with the last stage's measured busy time (elastic_hf_cost_model_error).
        assert runner.last_cost_error is not None and 0 <= runner.last_cost_error < float("inf")
    assert calls, "lookahead was never used"
    split_steps = rowless = 0
    for inputs, micro_batches in calls:
        rowless += sum(not any(seq.needs_logits for seq in mb) for mb in micro_batches)
        pieces = [seq for mb in micro_batches for seq in mb]
        assert sum(len(s.token_ids) for s in pieces) == sum(len(s.token_ids) for s in inputs)
        # Each input's tokens in order: its pieces are consecutive and continue where the last one stopped.
        rebuilt, cursor = [], 0
        for seq in inputs:
            tokens = []
            while len(tokens) < len(seq.token_ids):
                piece = pieces[cursor]
                assert piece.num_computed == seq.num_computed + len(tokens)
                assert piece.needs_logits == (seq.needs_logits and len(tokens) + len(piece.token_ids)
                                              == len(seq.token_ids))
                tokens += piece.token_ids
                cursor += 1
            rebuilt.append(tokens)
        assert rebuilt == [s.token_ids for s in inputs]
        split_steps += len(pieces) > len(inputs)
    assert split_steps >= 1, "no step cut a sequence across micro-batches: the test did not exercise the split"
    assert rowless >= 1   # the last stage returned [0, vocab] for it and the rows still line up


def test_a_pipeline_without_a_profile_fits_its_cost_model_while_serving(pp_checkpoint):
    """No --cost-profile and none shipped: a 1x2 pipeline starts on token-count micro-batches, both stages report
    every step's busy time into the deployment's online fit, and once the reports determine a cost model the
    pipeline cuts its steps by it (here the reports are topped up with exact ones, so that happens on the next
    step whatever this machine's timing noise); greedy tokens stay HF's throughout."""
    import random

    from elastic_hf.engine.cost_model import Chunk

    reference, tokenizer = load_hf_model(pp_checkpoint)
    prompts = mixed_prompts(tokenizer, 4, 3, 100, seed=33)
    with ElasticModel.from_pretrained(pp_checkpoint, workers=2, topology="1x2", kv_cache_memory=4 << 20,
                                      max_num_batched_tokens=48) as model:
        overload = model.deployment.overload
        runner = model.deployment.instances[0].runner
        fit = overload.cost_fit
        assert overload.cost_model is None and fit is not None and runner.cost_fit is fit and runner.lookahead is None
        first = model.generate(prompts[:2], max_tokens=MAX_NEW)
        if overload.cost_model is None:
            assert fit.num_samples >= 2 and fit.num_samples % 2 == 0   # both stages, every pipelined step
            rng = random.Random(0)
            for _ in range(64):   # exact reports of COST's shape: the next attempt determines the model
                mbs = [[Chunk(rng.randint(0, 500), rng.choice((1, rng.randint(2, 64))), rng.random() < 0.7)
                        for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 2))]
                fit.add(mbs, 0.4, False, sum(COST.batch_cost(mb, 0.4, last_stage=False) for mb in mbs))
                fit.add(mbs, 0.6, True, sum(COST.batch_cost(mb, 0.6) for mb in mbs))
        rest = model.generate(prompts[2:], max_tokens=MAX_NEW)
        assert overload.cost_model is not None and overload.cost_fit is None
        assert runner.lookahead is overload.cost_model and runner.cost_fit is None
        assert runner.last_cost_error is not None   # a lookahead step ran and was compared with its stage time
    assert [o.outputs[0].token_ids for o in first + rest] == [hf_greedy(reference, p, MAX_NEW) for p in prompts]
