"""The two executors of parallel/executor.py: the one worker of a single-worker model (in this process, a direct
call) and worker processes (forked from a preloaded fork server, a pipe each, death detection and replacement). A
method may name a sub-object of the Worker ("morph.sync"); private names are refused. Only small control data
travels through the pipes; tensors between workers use torch.distributed."""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import os
import signal
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from elastic_hf.config import EngineConfig
from elastic_hf.parallel.executor import Executor, PendingRPC, resolve_method, rpc_name
from elastic_hf.parallel.rendezvous import LoopbackWorld, Rendezvous

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    def __init__(self, worker: int, method: str, message: str, remote_traceback: str | None = None):
        super().__init__(f"worker {worker} failed in {method}: {message}")
        self.worker = worker
        self.method = method
        self.remote_traceback = remote_traceback
        self.failed_workers = [worker]   # every worker that failed the same collective call (this one first)


def raise_first(errors: list[WorkerError]) -> None:
    """Raise the first failure of a collective call, naming every worker that failed it."""
    if errors:
        errors[0].failed_workers = [e.worker for e in errors]
        raise errors[0]


def finish_collective(executor, method: str, workers, results: dict, errors: list[WorkerError], hung,
                      timeout: float | None) -> list:
    """The end of a collective call: workers without an answer by the deadline (hung, deadlocked, or waiting in a
    collective on one that is) are ended, so the deployment replaces them and recomputes their instance's requests;
    then the first failure is raised, or the results come back in the order of `workers`."""
    for w in hung:
        executor.kill(w)
        errors.append(WorkerError(w, method, f"no answer within {timeout:.1f} s: ended as hung, to be replaced"))
    raise_first(errors)
    return [results[w] for w in workers]


class InProcessExecutor(Executor):
    """The single worker of a one-worker model, driven by direct calls (exceptions keep their type); steps run in
    the caller's thread."""

    def __init__(self, worker):
        self.worker = worker
        self.num_workers = 1
        self.crosses_processes = False   # results come back as the objects the worker made: no pipe to spare

    def collective_rpc(self, method: str | Callable, args: tuple = (), workers: Iterable[int] | None = None,
                       timeout: float | None = None) -> list:
        # timeout: not applicable, an in-process call cannot be interrupted (and a hang here hangs the caller alike)
        workers = (0,) if workers is None else tuple(workers)
        if any(w != 0 for w in workers):
            raise ValueError(f"workers must be 0 in a single-worker model, got {list(workers)}")
        target = resolve_method(self.worker, rpc_name(method))
        return [target(*args) for _ in workers]

    def check_health(self) -> list[int]:
        return []

    def replace(self, dead: list[int], topology: tuple[int, ...]) -> None:
        raise RuntimeError("an in-process worker cannot die without its process")

    def shutdown(self) -> None:
        self.worker.shutdown()


# What a worker process imports before it loads anything: the fork server imports it once, and every worker (at
# start, after a crash, on the next deployment of this process) forks from it instead of importing torch and
# transformers anew (seconds of CPU per worker; the workers of one deployment start at the same time).
WORKER_PRELOAD = ["torch", "transformers", "elastic_hf.parallel.worker"]
_context = None


def worker_context():
    """The multiprocessing context worker processes start from: a fork server with torch, transformers and the
    worker preloaded (nothing in it has started a thread pool or touched CUDA, so forking it is safe), or plain
    spawn where ELASTIC_HF_WORKER_START=spawn or the platform has no fork server."""
    global _context
    if _context is None:
        import multiprocessing

        method = os.environ.get("ELASTIC_HF_WORKER_START", "forkserver")
        if method not in ("forkserver", "spawn"):
            raise ValueError(f"ELASTIC_HF_WORKER_START must be 'forkserver' or 'spawn', got {method!r}")
        if method not in multiprocessing.get_all_start_methods():
            method = "spawn"
        _context = torch.multiprocessing.get_context(method)
        if method == "forkserver":
            _context.set_forkserver_preload(WORKER_PRELOAD)
    return _context


def encode_result(result):
    # Logits cross the pipe as numpy: pickling a torch tensor through a spawn-context pipe would move it to shared
    # memory first, a much slower path for a per-step result. A tuple (logits, stats) is encoded item by item.
    if isinstance(result, torch.Tensor):
        return ("tensor", result.cpu().numpy())
    if isinstance(result, tuple):
        return ("tuple", tuple(encode_result(item) for item in result))
    return ("value", result)


def decode_result(payload):
    kind, value = payload
    if kind == "tuple":
        return tuple(decode_result(item) for item in value)
    return torch.from_numpy(value) if kind == "tensor" else value


def prepare_worker_process(threads: int) -> None:
    """What a worker process sets before it builds its Worker (the pipe pool's and the Ray actors' alike)."""
    logging.basicConfig(level=os.environ.get("ELASTIC_HF_WORKER_LOG", "WARNING"))
    torch.set_num_threads(threads)
    # No tqdm bars in workers: they print per process, and tqdm's multiprocessing lock would outlive os._exit.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def worker_main(conn, config: EngineConfig, checkpoint_dir: str, worker_id: int, model_id: str, store,
                rendezvous: LoopbackWorld) -> None:
    """Process entry: build the Worker, then serve `call(method, *args)` requests until 'shutdown' or EOF."""
    # Ctrl+C in a terminal signals the whole process group: the driver decides (a server drains first, a script
    # closes the deployment), and a worker ends on its 'shutdown' call or when the driver's pipe closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    prepare_worker_process(config.threads_per_worker or max(1, (os.cpu_count() or 1) // config.num_workers))
    from elastic_hf.parallel.worker import worker_class

    try:
        worker = worker_class(config)(config, checkpoint_dir, worker_id=worker_id, model_id=model_id, store=store,
                                      rendezvous=rendezvous)
    except BaseException as exc:  # report the start failure instead of leaving the driver waiting
        conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    conn.send(("ok", ("value", worker.ping()), None))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            break
        try:
            result = resolve_method(worker, method)(*args)
            conn.send(("ok", encode_result(result), None))
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        if method == "shutdown":
            conn.close()
            os._exit(0)  # skip interpreter teardown (seconds with torch loaded); the arenas die with the process


class MultiprocessExecutor(Executor):
    """One process per worker (from worker_context()), a pipe to each. `collective_rpc` sends to every worker first
    and then collects, so the ranks of one instance run a step concurrently."""
    rendezvous: Rendezvous | None = None

    def __init__(self, config: EngineConfig, checkpoint_dir: str, model_id: str, store):
        self._of_processes(config, checkpoint_dir, model_id)
        self.store = store
        self._procs, self._conns = [], []
        # calls sent to each worker and not yet answered, oldest first (submit_rpc); answers come in this order
        self._in_flight: dict[int, deque[PendingRPC]] = {w: deque() for w in range(self.num_workers)}
        self.rendezvous = Rendezvous(config.start_timeout_s)
        world = self.rendezvous.new_world()
        try:
            for worker_id in range(self.num_workers):
                proc, conn = self._spawn(worker_id, world)
                self._procs.append(proc)
                self._conns.append(conn)
            for worker_id in range(self.num_workers):
                self._receive(worker_id, "start", timeout=config.start_timeout_s)
        except BaseException:
            self.close()
            raise
        # Instances step concurrently: one thread each, every one waiting on its workers' pipes.
        self.step_threads = ThreadPoolExecutor(max_workers=self.num_workers, thread_name_prefix="elastic-hf-instance")

    def _spawn(self, worker_id: int, world: LoopbackWorld, config: EngineConfig | None = None):
        ctx = worker_context()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker_main, daemon=True, name=f"elastic-hf-worker-{worker_id}",
                           args=(child, config or self.config, self.checkpoint_dir, worker_id, self.model_id,
                                 self.store, world))
        proc.start()
        child.close()
        return proc, parent

    def _receive(self, worker: int, method: str, timeout: float | None = None):
        conn = self._conns[worker]
        if timeout is not None and not conn.poll(timeout):
            raise WorkerError(worker, method, f"no answer within {timeout:.0f} s")
        try:
            status, result, remote_tb = conn.recv()
        except (EOFError, OSError) as exc:  # OSError: "got end of file during message", killed mid-send
            self._procs[worker].join(timeout=10)  # the pipe closes before the process is reaped
            code = self._procs[worker].exitcode
            raise WorkerError(worker, method, f"worker process died (exit code {code})") from exc
        if status != "ok":
            raise WorkerError(worker, method, result, remote_tb)
        return decode_result(result)

    # ------------------------------------------------------------------ calls in flight
    def submit_rpc(self, method: str | Callable, args: tuple = (), workers: Iterable[int] | None = None,
                   timeout: float | None = None) -> PendingRPC:
        method = rpc_name(method)
        workers = tuple(range(self.num_workers)) if workers is None else tuple(workers)
        call = PendingRPC(method, workers, None if timeout is None else time.monotonic() + timeout, timeout)
        for w in workers:
            try:
                self._conns[w].send((method, args))
                self._in_flight[w].append(call)
            except (BrokenPipeError, OSError) as exc:
                self._procs[w].join(timeout=10)
                call.errors.append(WorkerError(w, method, f"worker process is gone ({exc}, exit code "
                                                          f"{self._procs[w].exitcode})"))
        return call

    def wait_rpc(self, call: PendingRPC) -> list:
        for w in call.workers:
            while call in self._in_flight[w]:
                self._answer_next(w)
        raise_first(call.errors)
        return [call.results[w] for w in call.workers]

    def _answer_next(self, w: int) -> None:
        """Read worker w's answer to its oldest call in flight (a worker silent past that call's deadline is ended
        as hung, and every call still queued on it fails)."""
        queue = self._in_flight[w]
        call = queue[0]
        if call.deadline is not None and not self._conns[w].poll(max(0.0, call.deadline - time.monotonic())):
            self.kill(w, f"no answer within {call.timeout:.1f} s: ended as hung, to be replaced")
            return
        queue.popleft()
        try:
            call.results[w] = self._receive(w, call.method)
        except WorkerError as exc:
            call.errors.append(exc)
            if not self._procs[w].is_alive():
                self._fail_in_flight(w, str(exc))

    def _fail_in_flight(self, w: int, reason: str) -> None:
        for call in self._in_flight[w]:
            call.errors.append(WorkerError(w, call.method, reason))
        self._in_flight[w].clear()

    def end_blocked(self, workers: Iterable[int], grace_s: float) -> list[int]:
        ended = []
        deadline = time.monotonic() + grace_s
        for w in workers:
            while self._in_flight[w]:
                if not self._conns[w].poll(max(0.0, deadline - time.monotonic())):
                    self.kill(w, f"blocked on a dead peer for {grace_s:.0f} s: ended, to be replaced")
                    ended.append(w)
                    break
                self._answer_next(w)
        return ended

    def _settle(self, workers: Iterable[int]) -> None:
        """Collect every answer still owed by `workers` into its call, so the next answer on a pipe is the next
        call's."""
        for w in workers:
            while self._in_flight[w]:
                self._answer_next(w)

    def collective_rpc(self, method: str | Callable, args: tuple = (), workers: Iterable[int] | None = None,
                       timeout: float | None = None) -> list:
        method = rpc_name(method)
        workers = range(self.num_workers) if workers is None else tuple(workers)
        self._settle(workers)
        sent, errors = [], []
        for w in workers:
            try:
                self._conns[w].send((method, args))
                sent.append(w)
            except (BrokenPipeError, OSError) as exc:
                # as in _receive: reap it, so dead_workers() reports it and the deployment recovers at once
                self._procs[w].join(timeout=10)
                errors.append(WorkerError(w, method, f"worker process is gone ({exc}, exit code "
                                                     f"{self._procs[w].exitcode})"))
        results = {}
        pending = {self._conns[w]: w for w in sent}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            for conn in multiprocessing.connection.wait(list(pending), remaining):
                w = pending.pop(conn)
                try:
                    results[w] = self._receive(w, method)
                except WorkerError as exc:
                    errors.append(exc)
        # Every worker that answered was read, so no late answer is left in a pipe to be taken for the next call's.
        return finish_collective(self, method, workers, results, errors, pending.values(), timeout)

    def check_health(self) -> list[int]:
        return [w for w, proc in enumerate(self._procs) if not proc.is_alive()]

    def replace(self, dead: list[int], topology: tuple[int, ...]) -> None:
        """Replace dead worker processes: the survivors leave the broken torch.distributed world and form a new one
        with the replacements, which load their shard of the current `topology` from the shared host store."""
        config = dataclasses.replace(self.config, topology=topology)
        world = self.rendezvous.new_world()
        survivors = [w for w in range(self.num_workers) if w not in dead]
        for w in dead:
            self._fail_in_flight(w, "worker process died")
        self._settle(survivors)   # their answers to steps in flight (failures, mostly) are not the rejoin's
        for w in survivors:
            self._conns[w].send(("rejoin", (world,)))
        for w in dead:
            self._conns[w].close()
            self._procs[w], self._conns[w] = self._spawn(w, world, config)
        for w in dead:
            self._receive(w, "start", timeout=self.config.start_timeout_s)
        for w in survivors:
            self._receive(w, "rejoin")

    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def kill(self, worker: int, reason: str = "ended by the control plane") -> None:
        """End a worker that cannot be trusted any more (hung past a step's deadline, or failed after a reshape's
        commit point); recover() replaces it like any dead worker. Its calls in flight fail with `reason`."""
        self._procs[worker].kill()
        self._procs[worker].join(timeout=10)
        self._fail_in_flight(worker, reason)

    def shutdown(self) -> None:
        for w, conn in enumerate(self._conns):
            try:
                if self._procs[w].is_alive():
                    conn.send(("shutdown", ()))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._stop_threads_and_rendezvous()
