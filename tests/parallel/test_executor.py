"""The executor interface (parallel/executor.py): typed calls name Worker methods and reach sub-objects by their
RPC names, an executor is four methods (the step paths and shorthands come with the interface), the in-process
executor refuses other workers, and a worker extension class (vLLM's worker_extension_cls) adds RPC targets and
wraps the Worker's own methods without a line of it in the production Worker."""
import pytest

from elastic_hf import ElasticModel
from elastic_hf.config import EngineConfig
from elastic_hf.morph.executor import MorphExecutor
from elastic_hf.parallel.executor import Executor, rpc_name
from elastic_hf.parallel.worker import Worker, worker_class
from elastic_hf.parallel.worker_exchange import KVExchangeParticipant
from elastic_hf.parallel.worker_pool import InProcessExecutor


def test_typed_calls_name_worker_methods_and_sub_objects():
    assert rpc_name(Worker.init_kv) == "init_kv"
    assert rpc_name(Worker.execute_pipeline) == "execute_pipeline"
    assert rpc_name(MorphExecutor.sync) == "morph.sync"
    assert rpc_name(KVExchangeParticipant.room_blocks) == "exchange.room_blocks"
    assert rpc_name("arm_step_fault") == "arm_step_fault"
    with pytest.raises(ValueError, match="not a method"):
        rpc_name(len)


class _Echo:
    """A stand-in worker: answers with its id and what it got."""

    def __init__(self, me):
        self.me = me

    def execute(self, inputs, sampling):
        return ("logits", self.me, inputs, sampling)

    def execute_pipeline(self, micro_batches, sampling, exchange_cpu_share):
        return ("stage", self.me, micro_batches), {"busy_s": 0.0, "exchange_cpu_share": exchange_cpu_share}


class _LocalExecutor(Executor):
    """Everything an executor must implement: four methods."""

    def __init__(self, num_workers):
        self.workers = [_Echo(w) for w in range(num_workers)]
        self.num_workers, self.crosses_processes, self.dead = num_workers, False, []

    def collective_rpc(self, method, args=(), workers=None, timeout=None):
        name = rpc_name(method)
        workers = range(self.num_workers) if workers is None else workers
        return [getattr(self.workers[w], name)(*args) for w in workers]

    def check_health(self):
        return list(self.dead)

    def replace(self, dead, topology):
        self.dead = [w for w in self.dead if w not in dead]

    def shutdown(self):
        self.workers = []


def test_an_executor_is_four_methods_and_gets_the_step_paths():
    with pytest.raises(TypeError):
        Executor()   # abstract
    ex = _LocalExecutor(3)
    assert ex.execute_model((1, 2), ["in"], ["s"]) == ("logits", 1, ["in"], ["s"])     # the first rank's answer
    assert [r[0][1] for r in ex.execute_pipeline((0, 2), [["mb"]])] == [0, 2]
    assert [r[1]["exchange_cpu_share"] for r in ex.execute_pipeline((0, 1), [["mb"]], None, 1.0)] == [1.0, 1.0]
    assert ex.call(2, "execute", [], None)[1] == 2 and len(ex.call_many([0, 1], Worker.execute, [], None)) == 2
    ex.dead = [1]
    assert ex.dead_workers() == ex.check_health() == [1]
    ex.close()
    assert ex.workers == []


def test_in_process_executor_refuses_other_workers():
    ex = InProcessExecutor(_Echo(0))
    assert ex.collective_rpc(Worker.execute, ([], None))[0][1] == 0
    with pytest.raises(ValueError, match="must be 0"):
        ex.call(1, "execute", [], None)
    with pytest.raises(AttributeError, match="no RPC method"):
        ex.call(0, "_private")


class CountingExtension:
    """Adds an RPC target and wraps Worker.memory_report."""

    num_reports = 0

    def reports_made(self) -> int:
        return self.num_reports

    def memory_report(self):
        self.num_reports += 1
        return super().memory_report()


def test_worker_extension_adds_rpc_targets_and_wraps_worker_methods(tiny_checkpoint):
    assert worker_class(EngineConfig()) is Worker
    with pytest.raises(ValueError, match="cannot be imported"):
        worker_class(EngineConfig(worker_extension_cls="no_such_module.Nothing"))
    with pytest.raises(ValueError, match="package.module.ClassName"):
        EngineConfig(worker_extension_cls="Nothing")
    with ElasticModel.from_pretrained(tiny_checkpoint("llama"), kv_cache_memory=1 << 20,
                                      worker_extension_cls=f"{__name__}.CountingExtension") as model:
        pool = model.deployment.pool
        assert isinstance(pool.worker, Worker) and isinstance(pool.worker, CountingExtension)
        before = pool.call(0, "reports_made")
        model.memory_report()
        assert pool.call(0, "reports_made") == before + 1
        assert not hasattr(Worker, "arm_step_fault") and not hasattr(Worker, "reports_made")
