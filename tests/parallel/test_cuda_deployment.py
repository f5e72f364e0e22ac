"""Two worker processes on CUDA: NCCL process groups, a TP2 forward and a reshape [2] -> [1, 1] that migrates KV
between the workers, against one worker on the same device. NCCL refuses two ranks on one GPU ("Duplicate GPU
detected"), so on a one-GPU machine the test reports that and skips: a multi-process CUDA deployment needs a GPU per
worker."""
from __future__ import annotations

import pytest
import torch

from deployment_steps import run_steps
from tiny_models import build_tiny_checkpoint

pytestmark = pytest.mark.gpu

# hidden 64 / 8 heads, 4 KV heads (TP2 splits them 2 + 2)
SHAPE = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4)
MAX_NEW = 12


def _prompts(num: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(num)]


def test_tp2_and_a_reshape_to_two_instances_match_one_worker(tmp_path):
    from elastic_hf import ElasticModel
    from elastic_hf.engine.sampling_params import SamplingParams

    path = str(build_tiny_checkpoint("llama", tmp_path / "llama", tokenizer="bytes", **SHAPE))
    prompts = _prompts(6, seed=21)
    options = dict(device="cuda", dtype="float32", kv_cache_memory=8 << 20, enforce_eager=True)
    with ElasticModel.from_pretrained(path, **options) as single:
        want = [o.outputs[0].token_ids for o in single.generate(prompts, max_tokens=MAX_NEW, ignore_eos=True)]
    try:
        model = ElasticModel.from_pretrained(path, workers=2, tp=2, **options)
        dep = model.deployment
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        ids = [dep.add_request(None, p, params) for p in prompts]
        done = run_steps(dep, ids, {}, num_steps=4)      # TP2 forwards: NCCL all-reduces
    except Exception as exc:  # noqa: BLE001 - a worker's failure arrives as whatever the executor raises
        if torch.cuda.device_count() < 2 and "Duplicate GPU" in repr(exc) + str(getattr(exc, "__cause__", "")):
            pytest.skip(f"NCCL refuses two ranks on one GPU (needs one GPU per worker): {str(exc)[:300]}")
        raise
    with model:
        assert dep.reshape([1, 1]).committed and [i.tp for i in dep.instances] == [1, 1]
        run_steps(dep, ids, done)
        assert [done[r] for r in ids] == want
        assert dep.stats()["num_computed_prompt_tokens"] == sum(len(p) for p in prompts)   # KV moved, not recomputed
