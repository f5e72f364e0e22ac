"""Workers as Ray actors (vLLM's `--distributed-executor-backend ray`): a deployment that spans machines.

Ray places the workers (a placement group: one bundle per worker, STRICT_PACK per instance of the starting
topology by default so a TP group's all-reduces stay on one node, or SPREAD over the nodes), keeps their processes
and carries the control RPC; tensors between workers still move over torch.distributed (gloo on CPU, NCCL on GPU)
on the interface that holds each node's Ray address. The rendezvous store and the per-node host weight stores are
in parallel/ray_rendezvous.py. Failure semantics are those of the pipe pool (parallel/worker_pool.py): a dead actor
(its process, or its whole node) or one past a step's deadline fails the call with a WorkerError, `check_health`
names it and `replace` starts a new one in its bundle, which Ray moves to a live node when the old one is gone;
where no node has room for the bundle, the replacement runs on the live node with the fewest workers, outside
the placement group (a CPU worker then shares that node's cores; a GPU worker cannot, and the replacement fails
with the reason). A placement group none of whose workers lives any more is then removed: Ray's GCS retries an
unplaceable bundle in a busy loop, a whole core for as long as the group exists (measured: it starved the
replacement's start past 300 s on a 2-core machine with one other busy process)."""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from elastic_hf.config import EngineConfig
from elastic_hf.parallel.executor import Executor, PendingRPC, resolve_method, rpc_name
from elastic_hf.parallel.ray_rendezvous import NodeStoreView, NodeWeightStores, RayRendezvous
from elastic_hf.parallel.worker_pool import (WorkerError, decode_result, encode_result, finish_collective,
                                             prepare_worker_process, raise_first)
from elastic_hf.topology import Topology

log = logging.getLogger(__name__)

REBUNDLE_WAIT_S = 10.0   # how long a dead node's bundle may take to find another node before the fallback


@ray.remote(concurrency_groups={"watch": 1})
class RayWorker:
    """One worker process: the Worker of parallel/worker.py behind `call(method, args)` (one call at a time), and a
    `watch` call that never returns while the actor lives, so the driver learns of its death without polling."""

    def __init__(self, config: EngineConfig, checkpoint_dir: str, worker_id: int, model_id: str,
                 stores: list | None, world, threads: int):
        prepare_worker_process(threads)
        from elastic_hf.model.loader import parse_dtype
        from elastic_hf.parallel.worker import worker_class

        store = None if stores is None else NodeStoreView(stores, parse_dtype(config.dtype))
        self.worker = worker_class(config)(config, checkpoint_dir, worker_id=worker_id, model_id=model_id,
                                           store=store, rendezvous=world)
        self._ended = threading.Event()

    def where(self) -> dict:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    def call(self, method: str, args: tuple):
        try:
            return "ok", encode_result(resolve_method(self.worker, method)(*args)), None
        except BaseException as exc:  # the driver raises it as a WorkerError with this traceback
            return "error", f"{type(exc).__name__}: {exc}", traceback.format_exc()

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        self._ended.wait()


class LocalRay:
    """A Ray runtime started for this process (no cluster address given). Ray ties the processes it starts (GCS,
    raylet) to the thread that starts them (Linux's parent-death signal follows the thread), and a server builds its
    model on its engine thread, which ends before the model is closed: so they start from a thread of their own
    that lives until `stop`. SIGINT is blocked there, and the processes inherit that mask: they outlive a Ctrl+C in
    the terminal, so a server drains first and then stops them, as it does its own worker processes."""

    def __init__(self):
        self._stop = threading.Event()
        started, failure = threading.Event(), []

        def run():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                # "local": a new instance even where a `ray start` cluster runs on this machine (ray.init() alone
                # would join that one; --ray-address auto does)
                ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
            except BaseException as exc:  # re-raised in the caller
                failure.append(exc)
            finally:
                started.set()
            self._stop.wait()

        self._thread = threading.Thread(target=run, name="elastic-hf-ray", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]

    def stop(self) -> None:
        ray.shutdown()
        self._stop.set()


def connect(address: str | None) -> LocalRay | None:
    """Join the Ray cluster at `address` ("auto": the one this machine runs; None: RAY_ADDRESS's), or start a local
    one when neither is given and this process is not connected yet (returned: this process owns it)."""
    if ray.is_initialized():
        return None
    if address is None and not os.environ.get("RAY_ADDRESS"):
        return LocalRay()
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    return None


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, checkpoint_dir: str, model_id: str, hf_config):
        from elastic_hf.model.loader import parse_dtype

        self._of_processes(config, checkpoint_dir, model_id)
        self.local_ray = connect(config.ray_address)
        self.groups: list = []
        self._actors: list = [None] * self.num_workers
        self._bundles: list[tuple] = [None] * self.num_workers   # (placement group, bundle index)
        self._where: list[dict] = [{}] * self.num_workers
        self._watch: dict[int, ray.ObjectRef] = {}
        # Each worker's latest call: an actor answers its calls in the order sent, so when this one is answered
        # every earlier one is too (end_blocked waits on it alone).
        self._latest_call: dict[int, ray.ObjectRef] = {}
        self._killed: set[int] = set()
        self.rendezvous = self.stores = None
        try:
            self.rendezvous = RayRendezvous()
            self.stores = NodeWeightStores(checkpoint_dir, hf_config, parse_dtype(config.dtype)) \
                if self.num_workers > 1 else None
            self._place(Topology(config.topology))
            world = self.rendezvous.new_world() if self.num_workers > 1 else None
            for w in range(self.num_workers):
                self._actors[w] = self._spawn(w, world, config)
            self._started(range(self.num_workers), "start")
        except BaseException:
            self.shutdown()
            raise
        self.step_threads = ThreadPoolExecutor(max_workers=self.num_workers, thread_name_prefix="elastic-hf-instance")

    # ------------------------------------------------------------------ placement
    def _bundle(self) -> dict:
        cpus = self.config.threads_per_worker or 1
        return {"CPU": cpus, "GPU": 1} if self.config.device.startswith("cuda") else {"CPU": cpus}

    def _place(self, topology: Topology) -> None:
        """One STRICT_PACK group per instance of `topology` (a standby worker alone), or one SPREAD group."""
        if self.config.ray_placement == "spread":
            sets = [list(range(self.num_workers))]
        else:
            sets = [list(workers) for workers, _ in topology.instance_keys()]
            covered = {w for s in sets for w in s}
            sets += [[w] for w in range(self.num_workers) if w not in covered]
        strategy = "SPREAD" if self.config.ray_placement == "spread" else "STRICT_PACK"
        for workers in sets:
            group = placement_group([self._bundle()] * len(workers), strategy=strategy)
            self.groups.append(group)
            for i, w in enumerate(workers):
                self._bundles[w] = (group, i)
        for group in self.groups:
            try:
                ray.get(group.ready(), timeout=self.config.start_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(f"Ray cannot place {self.num_workers} workers of {self._bundle()} each "
                                   f"({strategy}, topology {topology}) within {self.config.start_timeout_s:.0f} s; "
                                   f"cluster resources: {ray.available_resources()}") from None

    def _bundle_node(self, w: int, wait_s: float = 0.0) -> str | None:
        """The node holding worker w's bundle, waiting up to `wait_s` for Ray to re-place it (when the cluster has
        the room at all); None: not placed, or w has no bundle any more (_release_unplaced_group)."""
        if self._bundles[w] is None:
            return None
        group, index = self._bundles[w]
        if wait_s > 0:
            free = ray.available_resources()
            if any(free.get(name, 0) < amount for name, amount in self._bundle().items()):
                wait_s = 0.0
        deadline = time.monotonic() + wait_s
        while True:
            table = placement_group_table(group)
            node = table.get("bundles_to_node_id", {}).get(index)
            if table.get("state") == "CREATED" and node:
                return node
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)

    def _threads(self, w: int, node: str) -> int:
        """torch threads of worker w on `node`: the configured count, else the node's CPUs shared by the
        deployment's workers there (in a bundle placed on it, or running on it outside any group)."""
        if self.config.threads_per_worker:
            return self.config.threads_per_worker
        cpus = next((n["Resources"].get("CPU", 1) for n in ray.nodes() if n["NodeID"] == node), 1)
        placed = {id(group): placement_group_table(group).get("bundles_to_node_id", {})  # one read each
                  for group in self.groups}
        here = {v for v, bundle in enumerate(self._bundles)
                if bundle is not None and placed[id(bundle[0])].get(bundle[1]) == node}
        here |= {v for v, where in enumerate(self._where) if where.get("node_id") == node}
        here.add(w)
        return max(1, int(cpus) // len(here))

    def _spawn(self, w: int, world, config: EngineConfig, wait_s: float = 0.0, replacing: Iterable[int] = ()):
        node = self._bundle_node(w, wait_s)
        options = {"num_gpus": 1 if config.device.startswith("cuda") else 0, "max_restarts": 0}
        if node is not None:
            group, index = self._bundles[w]
            options.update(num_cpus=self._bundle()["CPU"], scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index))
        else:
            node = self._fallback_node(w)
            self._release_unplaced_group(w, set(replacing))
            options.update(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        stores = self.stores.for_node(node) if self.stores is not None else None
        return RayWorker.options(**options).remote(config, self.checkpoint_dir, w, self.model_id, stores, world,
                                                   self._threads(w, node))

    def _release_unplaced_group(self, w: int, replacing: set[int]) -> None:
        """Remove worker w's placement group when it could not be re-placed and each of its workers is being
        replaced (none runs in it any more; removing a group ends the actors in it): Ray's GCS would otherwise
        retry the unplaceable bundle in a busy loop, taking a core from the replacements. A group that still holds
        a live worker (SPREAD placement) stays, and so does that cost, until a node with room joins."""
        if self._bundles[w] is None:
            return
        group = self._bundles[w][0]
        members = [v for v, bundle in enumerate(self._bundles) if bundle is not None and bundle[0] is group]
        if not set(members) <= replacing:
            return
        remove_placement_group(group)
        self.groups.remove(group)
        for v in members:
            self._bundles[v] = None
        log.warning("placement group of worker(s) %s removed: no live node has room for it", members)

    def _fallback_node(self, w: int) -> str:
        if self.config.device.startswith("cuda"):
            raise WorkerError(w, "replace", f"no live node has a free GPU for worker {w}'s bundle "
                                            f"(cluster resources: {ray.available_resources()})")
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        load = {n: sum(1 for v, where in enumerate(self._where) if v != w and where.get("node_id") == n)
                for n in alive}
        node = min(alive, key=lambda n: load[n])
        log.warning("worker %d's bundle has no room on any live node: its replacement runs on node %s beside %d "
                    "worker(s), outside the placement group", w, node[:12], load[node])
        return node

    def _started(self, workers: Iterable[int], method: str, extra: dict | None = None) -> None:
        """Wait for the constructors of `workers` (and the `extra` refs of other workers: rejoins), then watch."""
        refs = {self._actors[w].where.remote(): w for w in workers}
        refs.update({ref: w for w, ref in (extra or {}).items()})
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=self.config.start_timeout_s)
        errors = [WorkerError(refs[r], method, f"no answer within {self.config.start_timeout_s:.0f} s")
                  for r in pending]
        for ref in ready:
            w = refs[ref]
            try:
                answer = ray.get(ref)
            except ray.exceptions.RayError as exc:
                errors.append(WorkerError(w, method, _short(exc)))
                continue
            if isinstance(answer, dict):
                self._where[w] = answer
                self._watch[w] = self._actors[w].watch.remote()
                self._killed.discard(w)
            elif answer[0] != "ok":
                errors.append(WorkerError(w, method, answer[1], answer[2]))
        raise_first(errors)

    # ------------------------------------------------------------------ the executor interface
    def collective_rpc(self, method: str | Callable, args: tuple = (), workers: Iterable[int] | None = None,
                       timeout: float | None = None) -> list:
        return self.wait_rpc(self.submit_rpc(method, args, workers, timeout))

    def submit_rpc(self, method: str | Callable, args: tuple = (), workers: Iterable[int] | None = None,
                   timeout: float | None = None) -> PendingRPC:
        """An actor runs its calls one at a time in the order sent, so calls in flight need no bookkeeping."""
        method = rpc_name(method)
        workers = tuple(range(self.num_workers)) if workers is None else tuple(workers)
        call = PendingRPC(method, workers, None if timeout is None else time.monotonic() + timeout, timeout)
        call.handle = {self._actors[w].call.remote(method, args): w for w in workers}
        self._latest_call.update((w, ref) for ref, w in call.handle.items())
        return call

    def wait_rpc(self, call: PendingRPC) -> list:
        refs = call.handle
        remaining = None if call.deadline is None else max(0.0, call.deadline - time.monotonic())
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=remaining)
        results, errors = {}, []
        for ref in ready:
            w = refs[ref]
            try:
                status, payload, remote_tb = ray.get(ref)
            except ray.exceptions.RayError as exc:   # the actor (or its node) died
                errors.append(WorkerError(w, call.method, _short(exc)))
                continue
            if status != "ok":
                errors.append(WorkerError(w, call.method, payload, remote_tb))
            else:
                results[w] = decode_result(payload)
        return finish_collective(self, call.method, call.workers, results, errors, [refs[r] for r in pending],
                                 call.timeout)

    def end_blocked(self, workers: Iterable[int], grace_s: float) -> list[int]:
        """Workers among `workers` (the peers of a dead worker) whose latest call is not answered within `grace_s`
        are ended: they are blocked in a transfer with the dead peer (a lost node sends no reset; gloo fails the
        transfer only after its collective timeout). Returns them."""
        ended = []
        deadline = time.monotonic() + grace_s
        for w in workers:
            ref = self._latest_call.get(w)
            if ref is None or w in self._killed:
                continue
            ready, _ = ray.wait([ref], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                log.error("worker %d: its call did not end within %.0f s of its peer's death: ended, to be "
                          "replaced", w, grace_s)
                self.kill(w)
                ended.append(w)
        return ended

    def check_health(self) -> list[int]:
        refs = {ref: w for w, ref in self._watch.items()}
        ended, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0) if refs else ([], [])
        return sorted({refs[r] for r in ended} | self._killed)

    def replace(self, dead: list[int], topology: tuple) -> None:
        """New actors for `dead` (in their bundles, which Ray re-places when a node is gone); the survivors leave
        the broken torch.distributed world and form a new one with them."""
        config = dataclasses.replace(self.config, topology=topology)
        world = self.rendezvous.new_world()
        survivors = [w for w in range(self.num_workers) if w not in dead]
        rejoins = {w: self._actors[w].call.remote("rejoin", (world,)) for w in survivors}
        for w in dead:
            self._watch.pop(w, None)
            self._latest_call.pop(w, None)
            ray.kill(self._actors[w], no_restart=True)
            self._actors[w] = self._spawn(w, world, config, wait_s=REBUNDLE_WAIT_S, replacing=dead)
        self._started(dead, "start", rejoins)

    # ------------------------------------------------------------------ views and control
    def pids(self) -> list[int]:
        return [where.get("pid") for where in self._where]

    def nodes(self) -> list[str]:
        """The Ray node id of each worker."""
        return [where.get("node_id") for where in self._where]

    def kill(self, worker: int) -> None:
        """End a worker that cannot be trusted any more; recover() replaces it."""
        ray.kill(self._actors[worker], no_restart=True)
        self._killed.add(worker)

    def shutdown(self) -> None:
        live = [w for w, a in enumerate(self._actors) if a is not None and w not in self.check_health()]
        if live:
            ray.wait([self._actors[w].call.remote("shutdown", ()) for w in live], num_returns=len(live), timeout=30)
        for actor in self._actors:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self._actors = [None] * self.num_workers
        self._watch.clear()
        for group in self.groups:
            remove_placement_group(group)
        self.groups = []
        self._stop_threads_and_rendezvous()
        if self.stores is not None:
            self.stores.release()
        if self.local_ray is not None:
            self.local_ray.stop()
            self.local_ray = None


def _short(exc: BaseException) -> str:
    """The first line of a Ray error (its full text repeats the remote traceback)."""
    text = str(exc).strip().splitlines()
    return f"worker actor died: {type(exc).__name__}: {text[0] if text else ''}"
