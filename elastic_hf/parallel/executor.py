"""The executor interface: how the control plane reaches the workers of a deployment (vLLM's Executor). Two
implementations live in parallel/worker_pool.py: `InProcessExecutor` (the one worker of a single-worker model,
called directly) and `MultiprocessExecutor` (one spawned process per worker, a pipe each, death detection and
replacement); the third, `RayExecutor` (parallel/ray_executor.py), runs the workers as Ray actors across nodes.
Each implements `collective_rpc`, `check_health`, `replace` and `shutdown`, and everything above works unchanged
(parallel/executor_factory.py picks one).

Calls are typed: `collective_rpc(Worker.kv_capacity, (1, 0))` names the Worker method itself (a rename breaks at
import, not at run time); a method of a worker's sub-object (MorphExecutor.sync) travels as its dotted RPC name
("morph.sync"). A plain string name is accepted too (what an extension class adds: EngineConfig.
worker_extension_cls). Only small control data travels through the RPC; tensors between workers move through
torch.distributed."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

# Worker attribute under which each sub-object's methods are reached ("morph.sync")
RPC_SUB_OBJECTS = {"MorphExecutor": "morph", "ReshapeParticipant": "reshape", "KVExchangeParticipant": "exchange"}


def rpc_name(method: str | Callable) -> str:
    """The RPC name of a Worker method (or of a method of one of its sub-objects), or a name given as is."""
    if isinstance(method, str):
        return method
    owner, _, name = getattr(method, "__qualname__", "").rpartition(".")
    if not owner or not name or "." in owner:
        raise ValueError(f"{method!r} is not a method of the Worker or of one of its sub-objects")
    if owner in RPC_SUB_OBJECTS:
        return f"{RPC_SUB_OBJECTS[owner]}.{name}"
    return name


def resolve_method(worker, method: str):
    """The bound method a dotted RPC name points at on `worker`; AttributeError for private or unknown names."""
    target = worker
    for part in method.split("."):
        if not part or part.startswith("_"):
            raise AttributeError(f"worker has no RPC method {method!r}")
        target = getattr(target, part, None)
        if target is None:
            raise AttributeError(f"worker has no RPC method {method!r}")
    if not callable(target):
        raise AttributeError(f"worker has no RPC method {method!r}")
    return target


class PendingRPC:
    """A collective call sent and not yet answered (Executor.submit_rpc); Executor.wait_rpc gives its results. The
    base executor answers at submit time (`outcome`: its results or its error); an executor of worker processes
    fills `results` / `errors` as the answers come."""

    def __init__(self, method: str, workers: tuple[int, ...], deadline: float | None, timeout: float | None):
        self.method = method
        self.workers = workers
        self.deadline = deadline     # time.monotonic() by which every worker must have answered; None: no limit
        self.timeout = timeout
        self.results: dict[int, object] = {}
        self.errors: list = []
        self.outcome: list | BaseException | None = None   # set by the base executor's synchronous submit
        self.handle = None   # executor-specific (Ray's object refs)


class Executor(ABC):
    num_workers: int
    # Results cross a process boundary: a step's logits are then sampled where they are (Worker.execute with
    # sampling) rather than shipped back.
    crosses_processes: bool
    # Instances step concurrently on these threads, each waiting on its own workers; None: in the caller's thread.
    step_threads: ThreadPoolExecutor | None = None

    # How long a step may take before its unanswered workers count as hung (step_timeout(num_tokens)); None: wait
    step_timeout_s: float | None = None

    def _of_processes(self, config, checkpoint_dir: str, model_id: str) -> None:
        """What an executor of worker processes keeps of its deployment (parallel/worker_pool.py, ray_executor.py)."""
        self.config = config
        self.checkpoint_dir = checkpoint_dir
        self.model_id = model_id
        self.num_workers = config.num_workers
        self.crosses_processes = True
        self.step_timeout_s = config.step_timeout_s

    def _stop_threads_and_rendezvous(self) -> None:
        """The last of an executor of worker processes' shutdown, after its workers are gone."""
        if self.step_threads is not None:
            self.step_threads.shutdown(wait=False)
            self.step_threads = None
        if getattr(self, "rendezvous", None) is not None:
            self.rendezvous.close()
            self.rendezvous = None

    @abstractmethod
    def collective_rpc(self, method: str | Callable, args: tuple = (), workers: Iterable[int] | None = None,
                       timeout: float | None = None) -> list:
        """Run `method(*args)` on every worker of `workers` (default: all) at once; their results in that order.
        Raises WorkerError (the first failure) after every worker has answered or died; with `timeout` (seconds),
        workers that have not answered by then are ended as hung and fail the call too."""

    @abstractmethod
    def check_health(self) -> list[int]:
        """The workers that have died (empty when all live)."""

    @abstractmethod
    def replace(self, dead: list[int], topology: tuple) -> None:
        """Start new workers for `dead` under `topology`; the survivors rejoin the new torch.distributed world."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker; idempotent."""

    # ------------------------------------------------------------------ calls in flight
    def submit_rpc(self, method: str | Callable, args: tuple = (), workers: Iterable[int] | None = None,
                   timeout: float | None = None) -> PendingRPC:
        """Send a collective call and return without waiting (cross-step pipelining keeps a pipeline's next batch
        in flight while the previous one finishes). Every worker runs its calls in the order sent; any other call
        to a worker first collects the answers of the calls in flight there. This default runs the call at once."""
        workers = range(self.num_workers) if workers is None else tuple(workers)
        call = PendingRPC(rpc_name(method), tuple(workers), None, timeout)
        try:
            call.outcome = self.collective_rpc(method, args, workers, timeout)
        except BaseException as exc:  # noqa: BLE001 - raised by wait_rpc, as the call would have
            call.outcome = exc
        return call

    def wait_rpc(self, call: PendingRPC) -> list:
        """The results of a submitted call (in the order of its workers), or its first failure (WorkerError)."""
        if isinstance(call.outcome, BaseException):
            raise call.outcome
        return call.outcome

    def end_blocked(self, workers: Iterable[int], grace_s: float) -> list[int]:
        """Workers among `workers` (the peers of a dead worker) whose calls in flight are not answered within
        `grace_s` are ended: they are blocked in a transfer with the dead peer, which gloo would fail only after its
        collective timeout. Returns them (recovery replaces them like the dead). This default has no calls in
        flight to wait for."""
        return []

    @property
    def overlaps_calls(self) -> bool:
        """Do calls in flight overlap with the caller's work (worker processes), or does submit_rpc run them?"""
        return type(self).submit_rpc is not Executor.submit_rpc

    # ------------------------------------------------------------------ the step paths
    def step_timeout(self, inputs: list) -> float | None:
        """The deadline of a step over `inputs` (engine/step_plan.SeqStepInput): step_timeout_s plus 50 ms a token
        (a long prefill on a big model on CPU takes seconds), or None (wait forever)."""
        if self.step_timeout_s is None:
            return None
        return self.step_timeout_s + 0.05 * sum(len(getattr(i, "token_ids", ())) for i in inputs)

    def execute_model(self, workers: tuple[int, ...], inputs: list, sampling: list | None = None):
        """One step of a non-pipelined instance over `workers` (every rank runs it: the all-reduces need them);
        rank 0's logits [num_sampling_seqs, vocab], or its SampledStep when `sampling` is given."""
        return self.collective_rpc("execute", (inputs, sampling), workers, self.step_timeout(inputs))[0]

    def execute_pipeline(self, workers: tuple[int, ...], micro_batches: list[list], sampling: list | None = None,
                         exchange_cpu_share: float | None = None) -> list[tuple]:
        """One step of a pipelined instance: every worker gets all micro-batches; (result, stage stats) per worker,
        the last stage's rank 0 holding the logits (or SampledStep). exchange_cpu_share: a new cap for a KV
        exchange in flight on these workers (parallel/worker_exchange.py), None: unchanged."""
        timeout = self.step_timeout([i for batch in micro_batches for i in batch])
        return self.collective_rpc("execute_pipeline", (micro_batches, sampling, exchange_cpu_share), workers,
                                   timeout)

    def submit_pipeline(self, workers: tuple[int, ...], micro_batches: list[list], sampling: list | None = None,
                        exchange_cpu_share: float | None = None) -> PendingRPC:
        """execute_pipeline without waiting: wait_rpc(call) gives its results."""
        timeout = self.step_timeout([i for batch in micro_batches for i in batch])
        return self.submit_rpc("execute_pipeline", (micro_batches, sampling, exchange_cpu_share), workers, timeout)

    # ------------------------------------------------------------------ shorthands
    def call(self, worker: int, method: str | Callable, *args):
        return self.collective_rpc(method, args, (worker,))[0]

    def call_many(self, workers: Iterable[int], method: str | Callable, *args) -> list:
        return self.collective_rpc(method, args, workers)

    def dead_workers(self) -> list[int]:
        return self.check_health()

    def close(self) -> None:
        self.shutdown()
