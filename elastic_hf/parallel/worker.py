"""The data plane of one worker: its model instance (model/instance.py), and the executors of what the control plane
decides: steps, precision morphs (`morph`, a MorphExecutor) and reshape transactions (`reshape`, a
ReshapeParticipant). The same class serves a single-worker ElasticModel in-process and every process of a
multi-worker deployment; the control plane reaches it through one RPC entry point, `call(method, *args)`, where a
method may name a sub-object ("morph.sync", "reshape.prepare"). Tensors between workers move only through
torch.distributed (gloo on CPU, NCCL on GPU, TCPStore rendezvous)."""
from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import os

import torch

from elastic_hf.config import EngineConfig
from elastic_hf.engine.sampler import sample_remote
from elastic_hf.kv.kv_manager import KVResize
from elastic_hf.layers.host_rows_embedding import HostRowsEmbedding
from elastic_hf.layers.shard_layout import ModelShardSpec, allowed_tp_degrees
from elastic_hf.memory import default_page_size, process_rss_bytes
from elastic_hf.model.instance import LoadedModel, build_instance, load_model, use_layer_kernels, worker_device
from elastic_hf.model.weight_placement import PlacedWeights
from elastic_hf.morph.executor import MorphExecutor, prepare_layer_store
from elastic_hf.model.stage import StageSpec
from elastic_hf.parallel.groups import ProcessGroups
from elastic_hf.parallel.pipeline import StageLinks, run_pipeline_step
from elastic_hf.parallel.shard_transform import ShardedWeights
from elastic_hf.parallel.weight_store import SharedWeightStore
from elastic_hf.parallel.worker_exchange import KVExchangeParticipant
from elastic_hf.parallel.worker_reshape import ReshapeParticipant
from elastic_hf.topology import Topology, candidate_topologies

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120.0   # a peer that dies mid-transfer fails the collective instead of hanging for 30 min


def rss_anon_bytes() -> int:
    """Private anonymous RSS of this process: the arenas' pages, without the mapped shared weight store."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class Worker:
    def __init__(self, config: EngineConfig, checkpoint_dir: str, *, worker_id: int = 0, model_id: str = "",
                 store: SharedWeightStore | None = None, rendezvous=None):
        """A deployment worker (config.num_workers > 1) joins the torch.distributed world of `rendezvous` (a
        LoopbackWorld of parallel/rendezvous.py, or a RayWorld of parallel/ray_rendezvous.py: a store to meet in and
        the interface gloo/NCCL listen on) and shards its weights with
        ShardedWeights from the shared host `store`; a single worker places them whole."""
        if not 0 <= worker_id < config.num_workers:
            raise ValueError(f"worker_id must be in [0, {config.num_workers}), got {worker_id}")
        self.config = config
        self.me = worker_id
        self.is_sharded = config.num_workers > 1
        self.device = worker_device(config, worker_id)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.topology = Topology(config.topology)
        loaded = load_model(checkpoint_dir, config.dtype, self.device, config.trust_remote_code)
        loaded.adapter.for_workers(config.num_workers)
        self.loaded = loaded
        self.degrees = allowed_tp_degrees(config.num_workers, loaded.num_kv_heads)
        self.groups: ProcessGroups | None = None
        if self.is_sharded:
            if store is None or rendezvous is None:
                raise ValueError("a deployment worker needs the shared weight store and the rendezvous")
            self._join_world(rendezvous)
        layer_store = None
        if config.morph.enabled:
            # Variants are built from the plain model, before its weights move into the arena.
            layer_store = prepare_layer_store(config.morph, loaded.hf_model, loaded.adapter, loaded.layers,
                                                  checkpoint_dir, model_id)
        slot_bytes = layer_store.slot_bytes() if layer_store is not None else None
        page_size = config.page_size or default_page_size(self.device)
        headroom = layer_store.headroom_bytes(page_size) if layer_store is not None else 0
        place = self._sharded_placer(loaded, store, slot_bytes) if self.is_sharded else \
            (lambda budget, page: PlacedWeights.place(loaded.hf_model, loaded.layers, budget, self.device, page,
                                                      slot_bytes))
        self.instance = build_instance(config, loaded, place, headroom_bytes=headroom)
        if self.is_sharded and self.layer_range() is not None:
            # a pipeline stage gives back the vocabulary tables it does not read (after build_instance packed the
            # head: a table refilled later goes back in the layout its modules read)
            self.weights.release_tables(self.layer_range())
        self.morph: MorphExecutor | None = None
        if layer_store is not None:
            for precision in layer_store.precisions[1:]:   # the quantized variants run the fp layers' paths
                use_layer_kernels(config, loaded.adapter, layer_store.modules_of(precision), self.device)
            self.morph = MorphExecutor(layer_store, loaded.layers, self.instance.weights, self.instance.budget,
                                       headroom, self.device, lambda: self.instance.pool)
        self.reshape = ReshapeParticipant(self) if self.is_sharded else None
        self.exchange = KVExchangeParticipant(self) if self.is_sharded else None
        self.links: StageLinks | None = None
        self.last_pipeline_stats: dict | None = None
        # Read by a KV exchange's thread, which slows down while steps run (worker_exchange.py).
        self.steps_started = 0
        self.in_step = False
        self.apply_stage()

    # ------------------------------------------------------------------ assembly helpers
    def _join_world(self, rendezvous) -> None:
        import torch.distributed as dist

        rendezvous.pin_interfaces()
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=rendezvous.store(self.config.start_timeout_s), rank=self.me,
                                world_size=self.config.num_workers,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        self.groups = ProcessGroups(candidate_topologies(self.config.num_workers, self.degrees, with_standby=True),
                                    backend)

    def _sharded_placer(self, loaded: LoadedModel, store: SharedWeightStore, slot_bytes):
        role = self.groups.for_topology(self.topology, self.me)
        group, tp, rank = role if role is not None else (None, None, None)  # standby: no shard loaded
        layers = self.layer_range()

        def place(budget, page_size):
            self.spec = ModelShardSpec(loaded.hf_config.hidden_size, loaded.hf_config.intermediate_size,
                                       loaded.num_heads, loaded.num_kv_heads, loaded.head_dim,
                                       torch.empty((), dtype=loaded.dtype).element_size(), page_size, self.degrees)
            packed = self.config.packs_weights and self.device.type == "cpu"
            weights = ShardedWeights(loaded.hf_model, loaded.adapter, self.spec, budget, self.device, store, tp,
                                     rank, group, slot_bytes, layers, packed=packed)
            if self.config.packed_weights == "on" and not weights.num_packed:
                raise ValueError(f"packed_weights='on': no sharded linear of this {loaded.dtype} model packs "
                                 f"(native/decode_gemm.c off, not built for this CPU, or shapes not in 64-row blocks)")
            if packed:
                log.info("%d sharded linears keep their chunks packed for the native kernel", weights.num_packed)
            return weights
        return place

    def layer_range(self, topology: Topology | None = None) -> tuple[int, int] | None:
        """[start, end) decoder layers this worker holds in `topology` (default: the current one); None in
        standby."""
        return (topology or self.topology).layer_range(self.me, self.loaded.num_layers)

    def apply_stage(self) -> None:
        """Run the layers of this worker's pipeline stage in the current topology (all of them outside a
        pipeline), with links to the same TP rank of the neighbouring stages."""
        role = self.topology.role(self.me)
        pipelined = role is not None and role.pp > 1
        if pipelined or self.instance.runner.stage is not None:
            spec = StageSpec(*self.layer_range(), role.is_first_stage, role.is_last_stage) if pipelined \
                else StageSpec(0, self.loaded.num_layers)
            self.instance.runner.set_stage(spec, self.loaded.layers)
        self.links = None
        if pipelined:
            stages = self.topology.stages(role.instance)
            prev = None if role.is_first_stage else stages[role.stage - 1][role.rank]
            after = None if role.is_last_stage else stages[role.stage + 1][role.rank]
            self.links = StageLinks(prev, after, self.loaded.hf_config.hidden_size, self.loaded.dtype, self.device)

    # ------------------------------------------------------------------ views for the control plane and tests
    @property
    def hf_model(self):
        return self.instance.hf_model

    @property
    def weights(self):
        return self.instance.weights

    @property
    def budget(self):
        return self.instance.budget

    @property
    def pool(self):
        return self.instance.pool

    # ------------------------------------------------------------------ RPC: setup and steps
    def ping(self) -> int:
        return os.getpid()

    def info(self) -> dict:
        loaded = self.loaded
        head = loaded.hf_model.get_output_embeddings().weight
        return {"worker": self.me, "num_kv_heads": loaded.num_kv_heads, "num_layers": loaded.num_layers,
                "degrees": list(self.degrees), "page_size": self.instance.page_size,
                "budget_bytes": self.budget.total_bytes, "weights_tp1_bytes": self.weights.shard_bytes(1, 0),
                "replicated_weights_bytes": self.weights.shared_bytes,
                "headroom_bytes": self.instance.headroom_bytes, "device": str(self.device),
                "lm_head_bytes": head.numel() * head.element_size(),
                # the replicated bytes of a first and of a last pipeline stage (the vocabulary tables they read)
                "first_stage_replicated_bytes": self.weights.replicated_bytes((0, loaded.num_layers - 1))
                if self.is_sharded else self.weights.shared_bytes,
                "last_stage_replicated_bytes": self.weights.replicated_bytes((1, loaded.num_layers))
                if self.is_sharded else self.weights.shared_bytes,
                "kv_block_bytes_tp1": self.instance.kv_layout(1, 0).block_bytes}

    def shard_bytes(self, tp: int, rank: int) -> int:
        """Committed weight bytes of this worker as shard (tp, rank)."""
        return self.weights.shard_bytes(tp, rank)

    def kv_capacity(self, tp: int, rank: int, layers: tuple[int, int] | None = None) -> int:
        """KV blocks this worker could hold as shard (tp, rank) of `layers` (None: all)."""
        return self.instance.kv_capacity(tp, rank, None if layers is None else tuple(layers))

    def reshape_footprint(self, old: Topology, new: Topology) -> dict:
        """What a reshape old -> new would commit on this worker before its commit point (the control plane adds
        the KV blocks): weights while the KV migrates (layers kept, MLP already at the new shard when TP grows)
        and after the weights phase (the new shard; a worker going to standby keeps its shard until the commit),
        and the KV block bytes of the old and new roles (0 in standby)."""
        from elastic_hf.parallel.shard_transform import ATTENTION_KINDS, MLP_KINDS

        o, n = old.role(self.me), new.role(self.me)
        old_layers, new_layers = self.layer_range(old), self.layer_range(new)
        weights = self.weights
        if o is None:
            mid = weights.replicated_bytes()
        else:
            both = (max(old_layers[0], new_layers[0]), min(old_layers[1], new_layers[1])) if n is not None \
                else old_layers
            mlp_tp, mlp_rank = (n.tp, n.rank) if n is not None and n.tp > o.tp else (o.tp, o.rank)
            # prepare gives back the tables the new role does not read; it loads the ones it does last
            tables = weights.replicated_bytes(old_layers, new_layers) if n is not None \
                else weights.replicated_bytes(old_layers)
            mid = tables + weights.shard_bytes(o.tp, o.rank, both, ATTENTION_KINDS, shared=False) \
                + weights.shard_bytes(mlp_tp, mlp_rank, both, MLP_KINDS, shared=False)
        after = weights.shard_bytes(n.tp, n.rank, new_layers) if n is not None else weights.committed_bytes
        block = lambda role, layers: self.instance.kv_layout(role.tp, role.rank, layers).block_bytes  # noqa: E731
        return {"budget_bytes": self.budget.total_bytes, "headroom_bytes": self.instance.headroom_bytes,
                "weights_mid_bytes": mid, "weights_after_bytes": after,
                "old_block_bytes": block(o, old_layers) if o is not None else 0,
                "new_block_bytes": block(n, new_layers) if n is not None else 0, "page_size": self.instance.page_size}

    def init_kv(self, num_blocks: int) -> int:
        """Create this worker's KV pool for its role in the current topology with blocks 0..num_blocks-1 attached
        (the control plane's KV manager starts with the same ids). Returns the block bytes (0 in standby)."""
        role = self.topology.role(self.me)
        if role is None:
            return 0
        if self.pool is not None:
            raise RuntimeError(f"worker {self.me} already has a KV pool of {self.pool.num_blocks} blocks")
        self.instance.set_pool(self.instance.new_pool(role.tp, role.rank, num_blocks, self.layer_range()))
        return self.pool.layout.block_bytes

    def resize_kv(self, resize: KVResize) -> list[int]:
        """Apply the instance's KV manager's resize to this worker's pool (kv/kv_manager.py: every worker of the
        instance gets the same one). Returns the newly attached ids."""
        if self.pool is None:
            raise RuntimeError(f"worker {self.me} has no KV pool in topology {self.topology}")
        return self.pool.resize(resize)

    def execute(self, inputs, sampling=None):
        """One step of this worker's instance. Every rank runs it (the all-reduces need them); rank 0 returns the
        logits [num_sampling_seqs, vocab], or with `sampling` (one RemoteSampling per sampling row) the tokens
        sampled from them (a SampledStep); the others None."""
        with self._stepping():
            logits = self.instance.runner.execute(inputs)
        role = self.topology.role(self.me)
        if role is None or role.rank != 0:
            return None
        return logits if sampling is None else sample_remote(logits, sampling)

    def execute_pipeline(self, micro_batches, sampling=None, exchange_cpu_share: float | None = None):
        """One step of this worker's pipeline stage over the step's micro-batches (parallel/pipeline.py). The last
        stage's rank 0 returns the logits of all of them in order (sampled into a SampledStep with `sampling`, as
        `execute`), the others None; each returns its stage timings (busy, wall, bubble ratio) alongside.
        exchange_cpu_share: the cap of a KV exchange in flight from now on (worker_exchange.py)."""
        if self.links is None:
            raise RuntimeError(f"worker {self.me} is not a pipeline stage in topology {self.topology}")
        if exchange_cpu_share is not None and self.exchange is not None:
            self.exchange.set_cpu_share(exchange_cpu_share)
        role = self.topology.role(self.me)
        with self._stepping():
            logits, stats = run_pipeline_step(self.instance.runner, self.links, micro_batches)
        self.last_pipeline_stats = {"worker": self.me, "stage": role.stage, "busy_s": stats.busy_s,
                                    "wall_s": stats.span_s, "bubble_ratio": stats.bubble_ratio,
                                    "gap_s": stats.gap_s, "recv_s": stats.recv_s, "flush_s": stats.flush_s,
                                    "sent_bytes": stats.sent_bytes,
                                    # a KV exchange's and a restore's weight load's progress, so the control
                                    # plane need not ask mid-step
                                    "exchange": self.exchange.report() if self.exchange is not None else None,
                                    "prewarm": self.reshape.prewarm_report() if self.reshape is not None else None}
        if not (role.is_last_stage and role.rank == 0):
            return None, self.last_pipeline_stats
        return (logits if sampling is None else sample_remote(logits, sampling)), self.last_pipeline_stats

    @contextlib.contextmanager
    def _stepping(self):
        self.steps_started += 1
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False

    def morph_info(self):
        if self.morph is None:
            raise ValueError(f"worker {self.me} does not morph: start it with a morph mode")
        return self.morph.info()

    def memory_report(self) -> dict:
        """Committed bytes per owner from this worker's budget ledger, KV blocks, and the process's RSS."""
        budget, pool = self.budget, self.pool
        report = {"worker": self.me, "budget_bytes": budget.total_bytes, "weights_bytes": budget.used_bytes("weights"),
                  "kv_bytes": budget.used_bytes("kv"), "free_bytes": budget.free_bytes,
                  "kv_blocks": pool.num_blocks if pool is not None else 0,
                  "kv_block_bytes": pool.layout.block_bytes if pool is not None else 0,
                  "kv_block_size": self.instance.block_size, "headroom_bytes": self.instance.headroom_bytes,
                  "ledger": budget.report(), "rss_bytes": process_rss_bytes(), "rss_anon_bytes": rss_anon_bytes(),
                  "topology": str(self.topology), "layers": self.layer_range()}
        if self.morph is not None:
            report["layer_store"] = self.morph.store.report()
        if self.is_sharded:
            report["packed_linears"] = self.weights.num_packed
            # the vocabulary tables among weights_bytes: a pipeline stage holds those it reads (stage_tables.py)
            report["table_bytes"] = self.weights.tables.held_bytes(self.loaded.num_layers)
            report["host_embedding_rows"] = isinstance(self.loaded.hf_model.get_input_embeddings(),
                                                       HostRowsEmbedding)
        return report

    def rejoin(self, rendezvous) -> None:
        """After a peer died: leave the broken world and join the new one with its replacement, rebuilding every
        candidate topology's group (the same collective order as at start)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self._join_world(rendezvous)
        role = self.groups.for_topology(self.topology, self.me)
        if role is not None:
            self.weights.set_group(role[0])
        self.apply_stage()

    def shutdown(self) -> None:
        if self.is_sharded:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def worker_class(config: EngineConfig) -> type[Worker]:
    """The class every worker of `config` is built from: Worker, or with config.worker_extension_cls
    ("package.module.ClassName", vLLM's --worker-extension-cls) a subclass that mixes that class in first, so its
    methods become RPC targets and may wrap Worker's own (super() reaches them)."""
    name = config.worker_extension_cls
    if name is None:
        return Worker
    module_name, _, class_name = name.rpartition(".")
    try:
        extension = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"worker_extension_cls={name!r} cannot be imported: {exc}") from exc
    if not isinstance(extension, type):
        raise ValueError(f"worker_extension_cls={name!r} is not a class")
    return type(f"{extension.__name__}Worker", (extension, Worker), {})
