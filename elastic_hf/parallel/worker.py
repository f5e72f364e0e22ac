"""The data plane of a multi-worker deployment: one Worker per process holds a shard of the model (ShardedWeights)
and the KV pool of its KV-head range, and executes steps and reshape transactions that the control plane sends as
data through one RPC entry point, `call(method, *args)` over a pipe. Tensors between workers move only through
torch.distributed (gloo on CPU, NCCL on GPU, TCPStore rendezvous)."""
from __future__ import annotations

import datetime
import logging
import os
import traceback
from dataclasses import dataclass

import torch

from elastic_hf.kv.layout import KVLayout
from elastic_hf.kv.page_pool import KVPagePool
from elastic_hf.layers.cpu_gemm import use_onednn_linears
from elastic_hf.memory import MemoryBudget, create_arena
from elastic_hf.parallel.groups import ProcessGroups
from elastic_hf.topology import Topology, candidate_topologies
from elastic_hf.kv.migration_plan import head_range
from elastic_hf.parallel.kv_migration import migrate_kv
from elastic_hf.parallel.reshape_plan import ReshapePlan
from elastic_hf.parallel.shard_transform import (ATTENTION_KINDS, MLP_KINDS, ShardedWeights, gather_weights,
                                                 weight_gather_plan)
from elastic_hf.layers.shard_layout import ModelShardSpec, allowed_tp_degrees
from elastic_hf.parallel.weight_store import SharedWeightStore

log = logging.getLogger(__name__)

RESHAPE_STAGES = ("weights_first", "kv_trim", "kv_migrate", "weights_last", "prepared")  # before the commit point
FAULT_STAGES = RESHAPE_STAGES + ("committed",)
RESHAPE_PHASES = ("prepare_reshape", "migrate_reshape_kv", "finish_reshape_weights")


@dataclass(slots=True)
class WorkerConfig:
    checkpoint_dir: str
    worker_id: int
    num_workers: int
    topology: tuple[int, ...]
    master_port: int
    master_addr: str = "127.0.0.1"
    dtype: str = "float32"
    device: str = "cpu"              # "cpu" or "cuda" (worker i uses cuda:i)
    block_size: int = 16
    kv_cache_memory: int = 64 << 20  # KV bytes this worker has as a TP1 instance; the budget adds the weights
    page_size: int | None = None
    num_threads: int | None = None
    collective_timeout_s: float = 120.0

    def __post_init__(self):
        if not 0 <= self.worker_id < self.num_workers:
            raise ValueError(f"worker_id must be in [0, {self.num_workers}), got {self.worker_id}")
        if sum(self.topology) > self.num_workers:
            raise ValueError(f"topology {list(self.topology)} needs {sum(self.topology)} workers, "
                             f"have {self.num_workers}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")


def rss_anon_bytes() -> int:
    """Private anonymous RSS of this process: the arenas' pages, without the mapped shared weight store."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class Worker:
    def __init__(self, config: WorkerConfig, store: SharedWeightStore):
        import torch.distributed as dist

        from transformers import AutoModelForCausalLM

        from elastic_hf.kv.paged_attention import register_paged_attention
        from elastic_hf.model.loader import parse_dtype
        from elastic_hf.model.runner import ModelRunner
        from elastic_hf.patches import get_adapter

        self.config = config
        self.me = config.worker_id
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.device == "cuda":
            self.device = torch.device("cuda", self.me % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        # A bounded timeout: a peer that dies mid-transfer fails the collective instead of hanging for 30 min.
        dist.init_process_group(backend, init_method=f"tcp://{config.master_addr}:{config.master_port}",
                                rank=self.me, world_size=config.num_workers,
                                timeout=datetime.timedelta(seconds=config.collective_timeout_s))
        self.dtype = parse_dtype(config.dtype)
        # No tqdm bars in workers: they print per process, and tqdm's multiprocessing lock would outlive os._exit.
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        attn = register_paged_attention()
        # The model only: the tokenizer lives in the control plane.
        self.hf_model = AutoModelForCausalLM.from_pretrained(config.checkpoint_dir, dtype=self.dtype,
                                                             attn_implementation=attn).eval().requires_grad_(False)
        hf_config = self.hf_model.config
        self.adapter = get_adapter(hf_config)
        num_heads, self.num_kv_heads, head_dim = self.adapter.head_counts(hf_config)
        degrees = allowed_tp_degrees(config.num_workers, self.num_kv_heads)
        self.groups = ProcessGroups(candidate_topologies(config.num_workers, degrees, with_standby=True), backend)
        self.topology = Topology(config.topology)
        role = self.groups.for_topology(self.topology, self.me)
        group, tp, rank = role if role is not None else (None, None, None)  # standby: no shard loaded
        probe = create_arena(self.device, 1 << 21, MemoryBudget(1 << 62), "probe", config.page_size)
        page_size = probe.page_size
        probe.close()
        self.spec = ModelShardSpec(hf_config.hidden_size, hf_config.intermediate_size, num_heads,
                                   self.num_kv_heads, head_dim, torch.empty((), dtype=self.dtype).element_size(),
                                   page_size, degrees)
        self.budget = MemoryBudget(1 << 62)  # resized below, once the TP1 weight bytes are known
        self.weights = ShardedWeights(self.hf_model, self.adapter, self.spec, self.budget, self.device, store,
                                      tp, rank, group)
        # Parameters are arena views on the device already; this moves the buffers (rotary tables) after them.
        self.hf_model.to(self.device)
        # The budget: this worker's memory as a TP1 instance, whatever shard it starts with.
        self.budget.total_bytes = self.weights.shard_bytes(1, 0) + config.kv_cache_memory
        self.head_dim = head_dim
        self.num_layers = hf_config.num_hidden_layers
        self.pool: KVPagePool | None = None
        use_onednn_linears(self.hf_model)  # the replicated LM head; the projections are ShardableLinear
        self.runner = ModelRunner(self.hf_model, None, getattr(hf_config, "sliding_window", None))
        self._txn: dict | None = None
        self._fault: tuple[str, bool] | None = None

    # ------------------------------------------------------------------ helpers
    def _role(self, topology: Topology) -> tuple[int, int, int] | None:
        return topology.role(self.me)

    def _layout(self, tp: int, rank: int) -> KVLayout:
        lo, hi = head_range(self.num_kv_heads, tp, rank)
        return KVLayout(self.num_layers, hi - lo, self.head_dim, self.config.block_size, self.dtype,
                        self.spec.page_size)

    def _new_pool(self, tp: int, rank: int, num_blocks: int) -> KVPagePool:
        layout = self._layout(tp, rank)
        max_blocks = self.budget.total_bytes // layout.block_bytes
        if num_blocks > max_blocks:
            raise ValueError(f"{num_blocks} KV blocks exceed the {max_blocks} that fit the worker's budget")
        arena = create_arena(self.device, max_blocks * layout.block_bytes, self.budget, "kv", self.spec.page_size)
        try:
            return KVPagePool(layout, arena, max_blocks, num_blocks)
        except BaseException:
            arena.close()
            raise

    def _check_fault(self, stage: str) -> None:
        if self._fault is None or self._fault[0] != stage:
            return
        _, kill = self._fault
        self._fault = None
        if kill:
            os._exit(17)  # a real process death, as a crash or an OOM kill would leave it
        raise RuntimeError(f"fault injected at reshape stage {stage!r} on worker {self.me}")

    # ------------------------------------------------------------------ RPC: setup and steps
    def ping(self) -> int:
        return os.getpid()

    def info(self) -> dict:
        return {"worker": self.me, "num_kv_heads": self.num_kv_heads, "num_layers": self.num_layers,
                "degrees": list(self.spec.degrees), "page_size": self.spec.page_size,
                "budget_bytes": self.budget.total_bytes, "weights_tp1_bytes": self.weights.shard_bytes(1, 0),
                "replicated_weights_bytes": self.weights.shared_bytes}

    def shard_bytes(self, tp: int, rank: int) -> int:
        """Committed weight bytes of this worker as shard (tp, rank)."""
        return self.weights.shard_bytes(tp, rank)

    def kv_capacity(self, tp: int, rank: int) -> int:
        """KV blocks this worker can hold as shard (tp, rank) once its weights are that shard."""
        free = self.budget.total_bytes - self.weights.shard_bytes(tp, rank)
        return max(free, 0) // self._layout(tp, rank).block_bytes

    def init_kv(self, num_blocks: int) -> int:
        role = self._role(self.topology)
        if role is None:
            return 0
        if self.pool is not None:
            raise RuntimeError(f"worker {self.me} already has a KV pool of {self.pool.num_blocks} blocks")
        self.pool = self._new_pool(role[1], role[2], num_blocks)
        self.runner.pool = self.pool
        return self.pool.layout.block_bytes

    def execute(self, inputs):
        """One step of this worker's instance. Every rank runs it (the all-reduces need them); rank 0 returns the
        logits [num_sampling_seqs, vocab] as a numpy array, the others None."""
        logits = self.runner.execute(inputs)
        role = self._role(self.topology)
        return logits.cpu().numpy() if role is not None and role[2] == 0 else None

    def memory_report(self) -> dict:
        return {"worker": self.me, "weights_bytes": self.budget.used_bytes("weights"),
                "kv_bytes": self.budget.used_bytes("kv"), "budget_bytes": self.budget.total_bytes,
                "kv_blocks": self.pool.num_blocks if self.pool is not None else 0,
                "rss_anon_bytes": rss_anon_bytes(), "topology": str(self.topology)}

    def arm_fault(self, stage: str | None, kill: bool = False) -> None:
        """Make the next reshape fail at `stage` (one of RESHAPE_STAGES): raise, or with kill=True end the process.
        For transaction tests and failure drills."""
        if stage is not None and stage not in FAULT_STAGES:
            raise ValueError(f"stage must be one of {FAULT_STAGES}, got {stage!r}")
        self._fault = None if stage is None else (stage, kill)

    def rejoin(self, master_port: int) -> None:
        """After a peer died: leave the broken world and join the new one with its replacement, rebuilding every
        candidate topology's group (the same collective order as at start)."""
        import torch.distributed as dist

        backend = dist.get_backend() if dist.is_initialized() else ("nccl" if self.device.type == "cuda" else "gloo")
        if dist.is_initialized():
            dist.destroy_process_group()
        self.config.master_port = master_port
        dist.init_process_group(backend, init_method=f"tcp://{self.config.master_addr}:{master_port}",
                                rank=self.me, world_size=self.config.num_workers,
                                timeout=datetime.timedelta(seconds=self.config.collective_timeout_s))
        self.groups = ProcessGroups(self.groups.topologies, backend)
        role = self.groups.for_topology(self.topology, self.me)
        if role is not None:
            self.weights.set_group(role[0])

    # ------------------------------------------------------------------ RPC: reshape transaction
    def prepare_reshape(self, plan: ReshapePlan) -> dict:
        """Phase 1 of 3 before the commit point: scale-up releases the MLP shards it no longer owns (MLP first, so
        the freed pages can take the migrated KV, Gyges §4.3); the old pool decommits its unused blocks. The
        control plane runs each phase on every worker and starts the next only when all succeeded, so no worker
        waits in a transfer on a peer that already failed. A worker may be in standby before (wake-up) or after
        (it hands its KV over and gives its shard back at the commit point)."""
        if self._txn is not None:
            raise RuntimeError(f"worker {self.me} already has a reshape in flight")
        old_role, new_role = self._role(plan.old), self._role(plan.new)
        old = self.groups.for_topology(plan.old, self.me)
        new = self.groups.for_topology(plan.new, self.me)
        kept = plan.is_kept(self.me) or (old_role is None and new_role is None)
        txn = {"plan": plan, "old": old, "new": new, "trimmed": [], "new_pool": None, "kept": kept,
               "stats": {"weights_bytes_before": self.budget.used_bytes("weights"),
                         "kv_bytes_before": self.budget.used_bytes("kv"), "kept": kept}}
        self._txn = txn
        if kept:  # same instance before and after: shard, pool and groups stay; it may receive moved KV
            return txn["stats"]
        if old is not None and new is not None and new[1] > old[1]:
            txn["stats"]["weights_first"] = self.weights.switch(MLP_KINDS, new[1], new[2], new[0])
        self._check_fault("weights_first")
        if self.pool is not None:
            # The old pool keeps its live blocks until the commit point (rollback needs them); the rest go back.
            live = set(plan.live_old_blocks[old_role[0]])
            block_bytes = self.pool.layout.block_bytes
            for block_id in range(self.pool.max_blocks):
                offset = block_id * block_bytes
                if block_id not in live and self.pool.arena.is_committed(offset, block_bytes):
                    self.pool.arena.decommit(offset, block_bytes)
                    txn["trimmed"].append(block_id)
        self._check_fault("kv_trim")
        return txn["stats"]

    def migrate_reshape_kv(self) -> dict:
        """Phase 2: a new pool for the new head range holds the live blocks (a kept instance receives into its own
        pool); KV moves by (block, head range), layer by layer."""
        txn = self._require_txn()
        plan: ReshapePlan = txn["plan"]
        old, new = txn["old"], txn["new"]
        if txn["kept"]:
            if new is None:
                return {}
            h0 = head_range(self.num_kv_heads, new[1], new[2])[0]
            kv = migrate_kv(plan.transfers, self.me, self.pool, h0, self.pool, h0)
            txn["stats"]["kv"] = {**kv, "new_pool_live_bytes": 0, "peak_extra_bytes": kv["peak_staging_bytes"]}
            return kv
        kv_before = self.budget.used_bytes("kv")
        new_pool = None
        if new is not None:
            new_pool = self._new_pool(new[1], new[2], plan.num_live_new_blocks[self._role(plan.new)[0]])
            txn["new_pool"] = new_pool
        old_h0 = head_range(self.num_kv_heads, old[1], old[2])[0] if old is not None else 0
        new_h0 = head_range(self.num_kv_heads, new[1], new[2])[0] if new is not None else 0
        kv = migrate_kv(plan.transfers, self.me, self.pool, old_h0, new_pool, new_h0)
        kv["new_pool_live_bytes"] = self.budget.used_bytes("kv") - kv_before
        kv["peak_extra_bytes"] = kv["new_pool_live_bytes"] + kv["peak_staging_bytes"]
        txn["stats"]["kv"] = kv
        self._check_fault("kv_migrate")
        return kv

    def finish_reshape_weights(self) -> dict:
        """Phase 3: attention (and, scaling down, the MLP after the KV) switch to the new shard; scale-down and
        wake-up load the chunks they now need from the shared host store or from peers. A worker going to
        standby keeps its shard until the commit point (rollback is then free)."""
        txn = self._require_txn()
        new = txn["new"]
        stats = txn["stats"]
        plan: ReshapePlan = txn["plan"]
        if plan.weights_source == "peers":
            layouts = {kind: lin.layout for kind, lin in self.weights.linears[0].items()}
            gather = weight_gather_plan(plan.old, plan.new, layouts, plan.kept_workers())
            stats["gather"] = gather_weights(self.weights, gather, self.me)
        if txn["kept"]:
            return stats
        if new is not None:
            stats["weights_last"] = self.weights.switch(ATTENTION_KINDS + MLP_KINDS, new[1], new[2], new[0])
        self._check_fault("weights_last")
        stats["weights_bytes_after"] = self.budget.used_bytes("weights")
        self._check_fault("prepared")
        return stats

    def commit_reshape(self) -> dict:
        """The commit point: drop the old KV pool, grow the new one to its capacity, serve the new topology (or
        go to standby: no pool, no shard, the process and its groups stay for a fast wake-up)."""
        txn = self._require_txn()
        plan: ReshapePlan = txn["plan"]
        if not txn["kept"]:
            if self.pool is not None:
                self.pool.arena.close()
            new_pool: KVPagePool | None = txn["new_pool"]
            self.pool = new_pool
            self.runner.pool = new_pool
            new_role = self._role(plan.new)
            if new_role is None:
                self.weights.release_all()
            elif plan.new_num_blocks[new_role[0]] > new_pool.num_blocks:
                new_pool.attach_blocks(plan.new_num_blocks[new_role[0]] - new_pool.num_blocks)
        self.topology = plan.new
        self._txn = None
        self._check_fault("committed")
        return self.memory_report()

    def abort_reshape(self) -> dict:
        """Roll back to the old topology: old weights shard (refilled from the host store), old KV pool."""
        txn = self._txn
        if txn is None:
            return self.memory_report()
        self._txn = None
        if txn["kept"]:  # moved KV landed in blocks that stay free in the old plan
            return self.memory_report()
        # Order matters for the budget: every step moves toward the old state, which fitted.
        if txn["new_pool"] is not None:
            txn["new_pool"].arena.close()
        if txn["old"] is None:
            self.weights.release_all()  # back to standby
        else:
            old_group, old_tp, old_rank = txn["old"]
            self.weights.switch(ATTENTION_KINDS + MLP_KINDS, old_tp, old_rank, old_group)
        if self.pool is not None:
            block_bytes = self.pool.layout.block_bytes
            for block_id in txn["trimmed"]:  # they were free: zero pages are fine
                self.pool.arena.commit(block_id * block_bytes, block_bytes)
        return self.memory_report()

    def _require_txn(self) -> dict:
        if self._txn is None:
            raise RuntimeError(f"worker {self.me} has no prepared reshape to commit")
        return self._txn

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main(conn, config: WorkerConfig, store: SharedWeightStore) -> None:
    """Process entry: build the Worker, then serve `call(method, *args)` requests until 'shutdown' or EOF."""
    logging.basicConfig(level=os.environ.get("ELASTIC_HF_WORKER_LOG", "WARNING"))
    try:
        worker = Worker(config, store)
    except BaseException as exc:  # report the start failure instead of leaving the driver waiting
        conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    conn.send(("ok", worker.ping(), None))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            break
        try:
            if method.startswith("_") or not callable(getattr(worker, method, None)):
                raise AttributeError(f"worker has no RPC method {method!r}")
            result = getattr(worker, method)(*args)
            conn.send(("ok", result, None))
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        if method == "shutdown":
            conn.close()
            os._exit(0)  # skip interpreter teardown (seconds with torch loaded); the arenas die with the process
