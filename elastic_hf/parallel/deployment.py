"""A multi-worker deployment: N worker processes (the data plane) under one control plane in this process, which
keeps a torch-free scheduler and an LLMEngine per instance and drives every instance's steps concurrently.

`reshape(new_topology)` changes the TP layout of the running deployment as a transaction (ReMP §3.9): quiesce at a
step boundary -> plan (sequence placement, block remap, 2-D KV migration) -> every worker prepares -> commit point
-> resume with merged or split schedulers. A failure before the commit point rolls every worker back and the old
instances keep serving their requests untouched."""
from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from elastic_hf.engine.llm_engine import LLMEngine
from elastic_hf.engine.metrics import EngineMetrics
from elastic_hf.engine.outputs import RequestOutput
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.engine.scheduler import Scheduler, SchedulerConfig
from elastic_hf.engine.tp_policy import InstanceLoad, TPPolicy, TPPolicyConfig
from elastic_hf.engine.sequence import Request, SeqStatus
from elastic_hf.kv.block_allocator import BlockAllocator
from elastic_hf.model.runner import SeqStepInput
from elastic_hf.topology import Topology, candidate_topologies, parse_topology
from elastic_hf.kv.migration_plan import BlockMove, build_migration_plan
from elastic_hf.parallel.metrics import DeploymentMetrics
from elastic_hf.parallel.reshape_plan import ReshapePlan
from elastic_hf.layers.shard_layout import allowed_tp_degrees
from elastic_hf.parallel.weight_store import SharedWeightStore
from elastic_hf.parallel.worker import RESHAPE_PHASES, WorkerConfig, worker_main

log = logging.getLogger(__name__)

SCALE_DOWN_BACKOFF_STEPS = 16  # steps to wait after a scale-down that did not fit before trying again


class WorkerError(RuntimeError):
    def __init__(self, worker: int, method: str, message: str, remote_traceback: str | None = None):
        super().__init__(f"worker {worker} failed in {method}: {message}")
        self.worker = worker
        self.method = method
        self.remote_traceback = remote_traceback


class ReshapeAborted(RuntimeError):
    """The transform failed before its commit point; the deployment still serves the old topology."""


@dataclass(slots=True)
class DeploymentOptions:
    num_workers: int = 2
    topology: tuple[int, ...] | None = None   # default: every worker a TP1 instance
    dtype: str = "float32"
    device: str = "cpu"
    kv_cache_memory: int = 64 << 20           # per worker, as a TP1 instance
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    page_size: int | None = None
    threads_per_worker: int | None = None     # default: cores / workers, at least 1
    tp_policy: str = "static"                 # "elastic": merge for long requests, split back (Gyges §5)
    router: str = "least_load"                # "elastic", "least_load" or "round_robin"
    scale_down_load: float = 0.5
    start_timeout_s: float = 300.0

    def __post_init__(self):
        if not 1 <= self.num_workers <= 8:
            raise ValueError(f"num_workers must be in [1, 8], got {self.num_workers}")
        if self.topology is None:
            self.topology = (1,) * self.num_workers
        self.topology = tuple(self.topology)
        if not 1 <= sum(self.topology) <= self.num_workers:
            raise ValueError(f"topology {list(self.topology)} covers {sum(self.topology)} workers, "
                             f"num_workers={self.num_workers} (the rest wait in standby)")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")


class InstanceRunner:
    """ModelRunner stand-in for the control plane: a step goes to every worker of the instance; rank 0's logits
    come back."""

    def __init__(self, deployment: "Deployment", workers: tuple[int, ...]):
        self.deployment = deployment
        self.workers = workers

    def execute(self, inputs: list[SeqStepInput]) -> torch.Tensor:
        results = self.deployment.call_many(self.workers, "execute", inputs)
        return torch.from_numpy(results[0])  # [num_sampling_seqs, vocab]


@dataclass(slots=True)
class Instance:
    workers: tuple[int, ...]
    engine: LLMEngine

    @property
    def tp(self) -> int:
        return len(self.workers)

    def load(self) -> float:
        allocator = self.engine.scheduler.allocator
        return allocator.num_used / max(allocator.num_total, 1)


@dataclass(slots=True)
class ReshapeReport:
    old: str
    new: str
    seconds: float
    committed: bool
    worker_stats: list[dict] = field(default_factory=list)
    num_moved_seqs: int = 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    def __init__(self, model: str | os.PathLike | None = None, **options):
        from transformers import AutoConfig, AutoTokenizer

        from elastic_hf.model.loader import parse_dtype, resolve_model
        from elastic_hf.patches import get_adapter

        self.options = DeploymentOptions(**options)
        opts = self.options
        resolved = resolve_model(model)
        self.model_id = resolved.model_id
        self.checkpoint_dir = resolved.checkpoint_dir
        self.config = AutoConfig.from_pretrained(self.checkpoint_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.checkpoint_dir)
        self.adapter = get_adapter(self.config)
        _, self.num_kv_heads, _ = self.adapter.head_counts(self.config)
        self.degrees = allowed_tp_degrees(opts.num_workers, self.num_kv_heads)
        self.candidates = candidate_topologies(opts.num_workers, self.degrees, with_standby=True)
        self.topology = Topology(opts.topology)
        if self.topology not in self.candidates:
            raise ValueError(f"topology {self.topology} is not a candidate for {opts.num_workers} workers and "
                             f"{self.num_kv_heads} KV heads: {[str(t) for t in self.candidates]}")
        self.store = SharedWeightStore.from_checkpoint(self.checkpoint_dir, self.adapter,
                                                       self.config.num_hidden_layers, parse_dtype(opts.dtype))
        eos = getattr(self.config, "eos_token_id", None)
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in self.eos_token_ids:
            self.eos_token_ids.append(self.tokenizer.eos_token_id)
        self.max_model_len = opts.max_model_len or min(getattr(self.config, "max_position_embeddings", 8192), 8192)
        self._seq_counter = itertools.count()
        self._request_counter = itertools.count()
        self.retired_prompt_tokens = 0
        self.reshapes: list[ReshapeReport] = []
        self.num_recoveries = 0
        self._capacities: dict[tuple[int, ...], int] = {}
        # One set of request metrics across every instance engine (engines come and go with reshapes); the
        # deployment's own metrics live in the same registry, so one /metrics page shows both.
        self.engine_metrics = EngineMetrics(self.model_id)
        self.metrics = DeploymentMetrics(self.engine_metrics.registry)
        self.metrics.set_topology(self.topology.sizes, self.degrees)
        self.policy = TPPolicy(TPPolicyConfig(opts.tp_policy, opts.router, opts.scale_down_load), self.degrees)
        self.long_request_ids: set[str] = set()
        self.num_rejected_reshapes = 0
        self._scale_down_backoff = 0
        self._procs, self._conns = [], []
        self._pool: ThreadPoolExecutor | None = None
        self.instances: list[Instance] = []
        try:
            self._start_workers()
            self.instances = self._build_instances(self.topology)
            self.tp1_blocks = self.call(0, "kv_capacity", 1, 0)  # what "long" means: more than a TP1 instance holds
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ workers
    def _spawn(self, worker_id: int, port: int):
        opts = self.options
        ctx = torch.multiprocessing.get_context("spawn")
        threads = opts.threads_per_worker or max(1, (os.cpu_count() or 1) // opts.num_workers)
        parent, child = ctx.Pipe()
        config = WorkerConfig(str(self.checkpoint_dir), worker_id, opts.num_workers, tuple(self.topology.sizes),
                              port, dtype=opts.dtype, device=opts.device, block_size=opts.block_size,
                              kv_cache_memory=opts.kv_cache_memory, page_size=opts.page_size, num_threads=threads)
        proc = ctx.Process(target=worker_main, args=(child, config, self.store), daemon=True,
                           name=f"elastic-hf-worker-{worker_id}")
        proc.start()
        child.close()
        return proc, parent

    def _start_workers(self) -> None:
        opts = self.options
        port = _free_port()
        for worker_id in range(opts.num_workers):
            proc, conn = self._spawn(worker_id, port)
            self._procs.append(proc)
            self._conns.append(conn)
        for worker_id in range(opts.num_workers):
            self._receive(worker_id, "start", timeout=opts.start_timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=opts.num_workers, thread_name_prefix="elastic-hf-instance")

    def dead_workers(self) -> list[int]:
        return [w for w, proc in enumerate(self._procs) if not proc.is_alive()]

    def recover(self) -> list[int]:
        """Replace dead worker processes under the current topology. The survivors leave the broken
        torch.distributed world and form a new one with the replacements, which load their shard from the shared
        host store. Requests of an instance that lost a worker lost part of their KV and are recomputed (the
        scheduler's preemption path); every other instance continues untouched. Returns the replaced ids."""
        dead = self.dead_workers()
        if not dead:
            return []
        port = _free_port()
        survivors = [w for w in range(self.options.num_workers) if w not in dead]
        for w in survivors:
            self._conns[w].send(("rejoin", (port,)))
        for w in dead:
            self._conns[w].close()
            self._procs[w], self._conns[w] = self._spawn(w, port)
        for w in dead:
            self._receive(w, "start", timeout=self.options.start_timeout_s)
        for w in survivors:
            self._receive(w, "rejoin")
        for inst in self.instances:
            lost = [w for w in inst.workers if w in dead]
            if not lost:
                continue
            scheduler = inst.engine.scheduler
            self.call_many(lost, "init_kv", scheduler.allocator.num_total)
            for seq in reversed(list(scheduler.running)):  # youngest first, so the oldest ends up in front
                scheduler._preempt(seq)
        self.num_recoveries += 1
        self.metrics.recoveries.inc()
        log.warning("replaced dead workers %s; topology %s", dead, self.topology)
        return dead

    def _receive(self, worker: int, method: str, timeout: float | None = None):
        conn = self._conns[worker]
        if timeout is not None and not conn.poll(timeout):
            raise WorkerError(worker, method, f"no answer within {timeout:.0f} s")
        try:
            status, result, remote_tb = conn.recv()
        except (EOFError, ConnectionResetError) as exc:
            self._procs[worker].join(timeout=10)  # the pipe closes before the process is reaped
            code = self._procs[worker].exitcode
            raise WorkerError(worker, method, f"worker process died (exit code {code})") from exc
        if status != "ok":
            raise WorkerError(worker, method, result, remote_tb)
        return result

    def call(self, worker: int, method: str, *args):
        """The one RPC entry point: run `method(*args)` on a worker and return its result."""
        return self.call_many((worker,), method, *args)[0]

    def call_many(self, workers, method: str, *args) -> list:
        """Send to every worker first (they run concurrently, e.g. the ranks of one TP step), then collect."""
        sent, errors = [], []
        for w in workers:
            try:
                self._conns[w].send((method, args))
                sent.append(w)
            except (BrokenPipeError, OSError) as exc:
                errors.append(WorkerError(w, method, f"worker process is gone ({exc})"))
        results = {}
        for w in sent:
            try:
                results[w] = self._receive(w, method)
            except WorkerError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return [results[w] for w in workers]

    # ------------------------------------------------------------------ instances
    def _instance_capacity(self, topology: Topology, idx: int) -> int:
        return self._capacity(topology.instances()[idx])

    def _new_engine(self, workers: tuple[int, ...], allocator: BlockAllocator) -> LLMEngine:
        opts = self.options
        scheduler = Scheduler(SchedulerConfig(opts.max_num_seqs, opts.max_num_batched_tokens, opts.block_size),
                              allocator)
        engine = LLMEngine(InstanceRunner(self, workers), scheduler, self.tokenizer, model_id=self.model_id,
                           max_model_len=self.max_model_len, vocab_size=self.config.vocab_size,
                           eos_token_ids=self.eos_token_ids, metrics=self.engine_metrics)
        engine._seq_counter = self._seq_counter  # sequence ids stay unique when sequences move between engines
        return engine

    def _build_instances(self, topology: Topology) -> list[Instance]:
        instances = []
        for idx, workers in enumerate(topology.instances()):
            num_blocks = self._instance_capacity(topology, idx)
            if num_blocks < 1:
                raise ValueError(f"instance {idx} (workers {list(workers)}) has no room for a KV block under "
                                 f"kv_cache_memory={self.options.kv_cache_memory}")
            self.call_many(workers, "init_kv", num_blocks)
            instances.append(Instance(workers, self._new_engine(workers, BlockAllocator(range(num_blocks)))))
        return instances

    # ------------------------------------------------------------------ requests
    def _blocks_needed(self, prompt_ids: list[int], params: SamplingParams) -> int:
        return -(-(len(prompt_ids) + params.max_tokens) // self.options.block_size)

    def _capacity(self, workers: tuple[int, ...]) -> int:
        """KV blocks of an instance on `workers` (fixed per worker set: the budgets do not change)."""
        if workers not in self._capacities:
            self._capacities[workers] = min(self.call(w, "kv_capacity", len(workers), rank)
                                            for rank, w in enumerate(workers))
        return self._capacities[workers]

    def loads(self) -> list[InstanceLoad]:
        out = []
        for idx, inst in enumerate(self.instances):
            allocator = inst.engine.scheduler.allocator
            num_long = sum(1 for r in inst.engine.requests if r in self.long_request_ids)
            half = inst.tp // 2
            split = self._capacity(inst.workers[:half]) + self._capacity(inst.workers[half:]) if half else 0
            out.append(InstanceLoad(idx, inst.tp, allocator.num_total, allocator.num_used, len(inst.engine.requests),
                                    num_long, split))
        return out

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, instance: int | None = None,
                    arrival_time: float | None = None) -> str:
        """Route a request (Gyges Alg. 1). Under the elastic TP policy a request that no instance can hold first
        merges instances (x2, a reshape at this step boundary)."""
        params = params or SamplingParams(temperature=0.0)
        request_id = request_id or f"dep-{next(self._request_counter)}"
        if any(request_id in inst.engine.requests for inst in self.instances):
            raise ValueError(f"request id {request_id!r} is already in use")
        if instance is not None and not 0 <= instance < len(self.instances):
            raise ValueError(f"instance must be in [0, {len(self.instances)}) for topology {self.topology}, "
                             f"got {instance}")
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) \
            else list(prompt)
        need = self._blocks_needed(prompt_ids, params) * params.n
        is_long = need > self.tp1_blocks
        if instance is None:
            for _ in range(len(self.degrees) + 1):
                loads = self.loads()
                instance, fits_now = self.policy.route(loads, need, is_long)
                never_fits = loads[instance].num_total_blocks < need
                router = self.policy.config.router
                wants_more = is_long and not fits_now and router == "elastic"
                if not (never_fits or wants_more):
                    break
                anchor = None if router == "elastic" else instance
                target = self.policy.scale_up_target(self.topology.sizes, loads, anchor)
                if target is None and anchor is not None:  # the baseline's pick has no equal neighbour
                    target = self.policy.scale_up_target(self.topology.sizes, loads, None)
                merged = False
                if target is not None:
                    try:
                        self.reshape(target)
                        merged = True
                    except (ValueError, ReshapeAborted) as exc:  # the old topology serves on
                        self.num_rejected_reshapes += 1
                        log.info("scale-up to %s refused: %s", list(target), exc)
                if not merged:
                    if never_fits:  # queue it on an instance that can ever hold it, if any
                        holders = [x for x in self.loads() if x.num_total_blocks >= need]
                        if holders:
                            instance = min(holders, key=lambda x: (x.load, x.index)).index
                    break
        engine = self.instances[instance].engine
        if engine.scheduler.allocator.num_total < need:
            raise ValueError(f"request needs {need} KV blocks; instance {instance} of topology {self.topology} "
                             f"holds {engine.scheduler.allocator.num_total} and the TP policy "
                             f"{self.policy.config.tp_policy!r} cannot merge further")
        engine.add_request(request_id, prompt_ids, params, arrival_time=arrival_time)
        if is_long:
            self.long_request_ids.add(request_id)
        return request_id

    def _maybe_scale_down(self) -> None:
        """Gyges Alg. 2 at a step boundary: split a merged instance once no long request is left on it and its
        load is low enough."""
        if not self.policy.is_elastic:
            return
        live = {r for inst in self.instances for r in inst.engine.requests}
        self.long_request_ids &= live
        if self._scale_down_backoff > 0:
            self._scale_down_backoff -= 1
            return
        target = self.policy.scale_down_target(self.topology.sizes, self.loads())
        if target is None:
            return
        try:
            self.reshape(target)
        except (ValueError, ReshapeAborted) as exc:
            # The running requests do not fit the split instances yet (the plan says so, or a worker's budget
            # refused the pages and the transaction rolled back): the old topology serves on, retry later.
            self.num_rejected_reshapes += 1
            self._scale_down_backoff = SCALE_DOWN_BACKOFF_STEPS
            log.info("scale-down to %s postponed: %s", list(target), exc)

    def abort_request(self, request_id: str) -> None:
        """Idempotent: a no-op for unknown or finished requests."""
        for inst in self.instances:
            if request_id in inst.engine.requests:
                inst.engine.abort_request(request_id)
        self.long_request_ids.discard(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(i.engine.has_unfinished_requests() for i in self.instances)

    def step(self) -> list[RequestOutput]:
        """One step of every instance with work, the instances running concurrently."""
        busy = [i for i in self.instances if i.engine.scheduler.has_work()]
        if not busy:
            return []
        futures = [self._pool.submit(inst.engine.step) for inst in busy]
        outputs, errors = [], []
        for future in futures:
            try:
                outputs.extend(future.result())
            except WorkerError as exc:  # that instance's step did not happen; its scheduler state is retryable
                errors.append(exc)
        if errors:
            if not self.dead_workers():
                raise errors[0]
            self.recover()
        self._maybe_scale_down()
        self._update_gauges()
        return outputs

    def _update_gauges(self) -> None:
        """Deployment-wide totals (each engine sets the shared gauges to its own numbers after its step)."""
        allocators = [i.engine.scheduler.allocator for i in self.instances]
        schedulers = [i.engine.scheduler for i in self.instances]
        self.engine_metrics.set_kv_blocks(sum(a.num_used for a in allocators), sum(a.num_total for a in allocators))
        self.engine_metrics.set_queue(sum(len(s.waiting) for s in schedulers), sum(len(s.running) for s in schedulers))

    def generate(self, prompts: list[list[int]] | list[str], max_tokens: int = 16, **sampling) -> list[RequestOutput]:
        params = SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, **sampling})
        ids = [self.add_request(p, params) for p in prompts]
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            for out in self.step():
                if out.finished:
                    results[out.request_id] = out
        return [results[r] for r in ids]

    def stats(self) -> dict:
        return {"topology": str(self.topology), "num_transforms": sum(r.committed for r in self.reshapes),
                "num_rolled_back": sum(not r.committed for r in self.reshapes),
                "transform_seconds": [round(r.seconds, 4) for r in self.reshapes if r.committed],
                "num_computed_prompt_tokens": self.retired_prompt_tokens + sum(
                    i.engine.num_computed_prompt_tokens for i in self.instances),
                "num_preemptions": sum(i.engine.scheduler.num_preemptions for i in self.instances),
                "instances": [{"workers": list(i.workers), **i.engine.stats()} for i in self.instances]}

    def memory_report(self) -> list[dict]:
        return self.call_many(range(self.options.num_workers), "memory_report")

    # ------------------------------------------------------------------ reshape
    def reshape(self, target, weights_source: str | None = None) -> ReshapeReport:
        """Change the topology in place, e.g. [1, 1] -> [2] -> [1, 1]. Call between steps (the deployment's own
        driver thread), which is the quiesce point. Raises ReshapeAborted when a worker fails before the commit
        point; the old topology is then still serving."""
        new = parse_topology(target)
        old = self.topology
        if new not in self.candidates:
            raise ValueError(f"topology {new} is not a candidate: {[str(t) for t in self.candidates]}")
        start = time.perf_counter()
        if new == old:
            return ReshapeReport(str(old), str(new), 0.0, True)
        # Scale-down refills shard chunks: over the GPU interconnect from peers is faster than host-to-device
        # copies; on CPU the shared host store is a plain memcpy and beats a loopback transfer.
        weights_source = weights_source or ("peers" if self.options.device == "cuda" else "host")
        plan, placement = self._plan(old, new, weights_source)
        workers = list(range(self.options.num_workers))
        try:
            stats = self.call_many(workers, RESHAPE_PHASES[0], plan)
            for phase in RESHAPE_PHASES[1:]:
                stats = self.call_many(workers, phase)
        except WorkerError as exc:
            self._release_taken(placement[2])
            self._rollback([w for w in workers if w not in self.dead_workers()])
            report = ReshapeReport(str(old), str(new), time.perf_counter() - start, False)
            self.reshapes.append(report)
            self.metrics.on_transform(False, report.seconds, [])
            self.recover()  # a worker that died before the commit point is replaced under the old topology
            raise ReshapeAborted(f"reshape {old} -> {new} rolled back: {exc}") from exc
        # ---- commit point: every worker holds the new shard, the migrated KV and the new groups ----
        try:
            self.call_many(workers, "commit_reshape")
        except WorkerError:
            if not self.dead_workers():
                raise
            self._resume(new, plan, placement)
            self.recover()  # after the commit point: replace the dead worker under the new topology
        else:
            self._resume(new, plan, placement)
        report = ReshapeReport(str(old), str(new), time.perf_counter() - start, True, stats, len(plan.seq_moves))
        self.reshapes.append(report)
        self.metrics.on_transform(True, report.seconds, stats)
        self.metrics.set_topology(new.sizes, self.degrees)
        return report

    def _rollback(self, workers: list[int]) -> None:
        for w in workers:
            try:
                self.call(w, "abort_reshape")
            except WorkerError as exc:  # a dead worker has nothing to roll back; it is reported by the caller
                log.error("rollback on worker %d failed: %s", w, exc)

    def _plan(self, old: Topology, new: Topology, weights_source: str = "host"):
        """Instances whose worker set does not change keep their engine, pool and block ids (and may receive
        requests, e.g. from a worker going to standby). Every request of a changing instance goes to a new instance
        that shares a worker with it (local heads stay local) or, failing that, to any; least-loaded first, with
        fresh block ids there. Blocks taken on a kept instance's allocator are listed for rollback."""
        new_instances = new.instances()
        old_instances = old.instances()
        kept = {new_idx: old_instances.index(ws) for new_idx, ws in enumerate(new_instances) if ws in old_instances}
        changing = [idx for idx in range(len(new_instances)) if idx not in kept]
        capacity = {idx: (self.instances[kept[idx]].engine.scheduler.allocator.num_total if idx in kept
                          else self._instance_capacity(new, idx)) for idx in range(len(new_instances))}
        allocators = {idx: (self.instances[kept[idx]].engine.scheduler.allocator if idx in kept
                            else BlockAllocator(range(capacity[idx]))) for idx in range(len(new_instances))}
        placement: dict[int, list[Request]] = {idx: [] for idx in range(len(new_instances))}
        moves: list[BlockMove] = []
        seq_moves: dict[int, tuple[int, int]] = {}
        live_old: dict[int, list[int]] = {}
        taken_on_kept: list[tuple[BlockAllocator, list[int]]] = []
        requests = []
        for old_idx, inst in enumerate(self.instances):
            live_old[old_idx] = [b for s in inst.engine.scheduler.running for b in s.block_ids]
            if old_idx not in kept.values():
                requests.extend((old_idx, r) for r in inst.engine.requests.values())
        requests.sort(key=lambda item: item[1].arrival_time)
        try:
            for old_idx, request in requests:
                old_workers = set(self.instances[old_idx].workers)
                need = sum(len(s.block_ids) for s in request.seqs)
                free = [idx for idx in allocators if allocators[idx].num_free >= need]
                local = [idx for idx in free if old_workers & set(new_instances[idx])]
                candidates = local or free
                if not candidates:
                    raise ValueError(f"reshape {old} -> {new}: request {request.request_id!r} holds {need} KV "
                                     f"blocks and no new instance has that many free "
                                     f"({ {i: a.num_free for i, a in allocators.items()} })")
                dst = min(candidates, key=lambda idx: (allocators[idx].num_used / max(capacity[idx], 1), idx))
                placement[dst].append(request)
                for seq in request.seqs:
                    seq_moves[seq.seq_id] = (old_idx, dst)
                    if seq.block_ids:
                        new_blocks = allocators[dst].allocate(len(seq.block_ids))
                        if dst in kept:
                            taken_on_kept.append((allocators[dst], new_blocks))
                        moves.append(BlockMove(old_idx, dst, tuple(seq.block_ids), tuple(new_blocks)))
            transfers = build_migration_plan(moves, old, new, self.num_kv_heads)
            plan = ReshapePlan(old, new, moves, transfers, live_old,
                               {idx: allocators[idx].num_used for idx in changing}, capacity, seq_moves, kept,
                               weights_source)
        except BaseException:
            self._release_taken(taken_on_kept)
            raise
        return plan, (placement, allocators, taken_on_kept)

    @staticmethod
    def _release_taken(taken: list[tuple[BlockAllocator, list[int]]]) -> None:
        for allocator, block_ids in taken:
            allocator.free(block_ids)

    def _resume(self, new: Topology, plan: ReshapePlan, placement) -> None:
        requests_by_instance, allocators, _ = placement
        new_block_ids = {}
        for move in plan.moves:
            new_block_ids[(move.src_instance, move.src_blocks)] = list(move.dst_blocks)
        old_instances = self.instances
        self.retired_prompt_tokens += sum(inst.engine.num_computed_prompt_tokens
                                          for idx, inst in enumerate(old_instances) if idx not in plan.kept.values())
        self.instances = []
        for idx, workers in enumerate(new.instances()):
            if idx in plan.kept:  # same engine, pool and blocks; moved requests join it
                instance = old_instances[plan.kept[idx]]
            else:
                instance = Instance(workers, self._new_engine(workers, allocators[idx]))
            engine = instance.engine
            running, waiting = [], []
            for request in requests_by_instance[idx]:
                engine.requests[request.request_id] = request
                for seq in request.seqs:
                    old_idx = plan.seq_moves[seq.seq_id][0]
                    if seq.block_ids:
                        seq.block_ids = new_block_ids[(old_idx, tuple(seq.block_ids))]
                    if seq.status is SeqStatus.RUNNING:
                        running.append(seq)
                    elif seq.status is SeqStatus.WAITING:
                        waiting.append(seq)
            if running or waiting:
                # Keep admission order: older sequences first, preemption hits the youngest.
                scheduler = engine.scheduler
                scheduler.running[:] = sorted(scheduler.running + running, key=lambda s: s.seq_id)
                merged_waiting = sorted(list(scheduler.waiting) + waiting, key=lambda s: s.seq_id)
                scheduler.waiting.clear()
                scheduler.waiting.extend(merged_waiting)
            self.instances.append(instance)
        self.topology = new

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
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
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def __enter__(self) -> "Deployment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Deployment", "DeploymentOptions", "ReshapeAborted", "WorkerError"]
