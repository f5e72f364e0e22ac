"""Tensor parallelism as a transform of a built HF model (gpt-fast style): every decoder layer's q/k/v/o and
gate/up/down Linear becomes a ShardableLinear in one weights arena; embeddings, norms, biases and the LM head are
replicated (a pipeline stage keeps only the vocabulary tables it reads: parallel/stage_tables.py). The HF forward
runs unchanged: attention reshapes with view(..., -1, head_dim), so a shard with fewer heads just works, the
registered paged attention reads the KV-head count from the key tensor, and o_proj/down_proj all-reduce over the TP
group.

Switching degree in place: load the chunks the new shard needs (from the shared host store) and release the pages of
the chunks it no longer owns. Scale-up only releases (no copy); scale-down loads."""
from __future__ import annotations

import torch
from torch import nn

from elastic_hf.layers.shard_layout import COLUMN_KINDS, SHARDED_KINDS, ModelShardSpec, PaddedLayout
from elastic_hf.layers.shardable_linear import ShardableLinear, fuse_shards
from elastic_hf.memory import MemoryBudget, create_arena
from elastic_hf.model.weight_placement import ArenaRange, param_range_bytes, place_params
from elastic_hf.parallel.stage_tables import StageTables
from elastic_hf.parallel.weight_store import SharedWeightStore, linear_module_names
from elastic_hf.topology import Topology
from elastic_hf.units import round_up

ATTENTION_KINDS = ("q", "k", "v", "o")
MLP_KINDS = ("gate", "up", "down")
FUSED_KINDS = (("q", "k", "v"), ("gate", "up"))   # linears of one input: one product where their shards allow


class ShardedWeights:
    """The weights of a tensor-parallel-capable worker. Arena layout: `[shared | layer 0 | layer 1 | ...]`, each
    layer `[quant slots | q k v o gate up down in their padded chunk layouts]`. The quant slots (reserved, not
    committed) exist only when the worker morphs precision; a morph runs on a TP1 shard, whose linears' chunks form
    one contiguous fp region per layer."""

    def __init__(self, hf_model: nn.Module, adapter, spec: ModelShardSpec, budget: MemoryBudget,
                 device: torch.device, store: SharedWeightStore, tp: int | None, rank: int | None, group=None,
                 slot_bytes: list[dict[str, int]] | None = None, layers: tuple[int, int] | None = None,
                 packed: bool = False):
        """layers: [start, end) decoder layers this worker holds (a pipeline stage); None: all. The arena reserves
        room for every layer; only held layers' chunks are committed. packed: the linears keep their chunks in the
        native kernel's layout where their shapes allow (layers/shardable_linear.py); `num_packed` says how many."""
        self.adapter = adapter
        self.spec = spec
        self.store = store
        self.layers = adapter.decoder_layers(hf_model)
        self.num_layers = len(self.layers)
        names = linear_module_names(adapter)
        linears = [{kind: layer.get_submodule(names[kind]) for kind in SHARDED_KINDS} for layer in self.layers]
        sharded_ids = {id(m.weight) for per_layer in linears for m in per_layer.values()}
        # The vocabulary tables get pages of their own (a pipeline stage that does not read one gives it back);
        # the other replicated parameters (norms, biases) share one range.
        table_ids = {id(p) for p in StageTables.table_params(hf_model)}
        seen: set[int] = set()
        shared = []
        for p in hf_model.parameters():
            if id(p) not in sharded_ids and id(p) not in seen and id(p) not in table_ids:
                seen.add(id(p))
                shared.append(p)
        layouts = {kind: spec.layout(kind) for kind in SHARDED_KINDS}
        page = spec.page_size
        rest_bytes = round_up(max(param_range_bytes(shared), 1), page)
        table_bytes = StageTables.extent(hf_model, page)
        # the replicated part of a whole-model role (a pipeline stage holds less of it: replicated_bytes)
        self.shared_bytes = rest_bytes + table_bytes
        self.layer_bytes = sum(lay.nbytes for lay in layouts.values())
        slot_extents = [{p: round_up(n, page) for p, n in (slot_bytes[i] if slot_bytes else {}).items()}
                        for i in range(self.num_layers)]
        capacity = self.shared_bytes + sum(self.layer_bytes + sum(e.values()) for e in slot_extents)
        self.arena = create_arena(device, capacity, budget, "weights", page)
        self.shared = place_params(shared, self.arena, 0)
        self.rest_bytes = rest_bytes
        self.tables = StageTables(hf_model, self.arena, rest_bytes, store, device)

        self.linears: list[dict[str, ShardableLinear]] = []
        self._fp_regions: list[ArenaRange] = []
        self._slots: list[dict[str, ArenaRange]] = []
        offset = self.shared_bytes
        with torch.no_grad():
            for layer_idx, (layer, per_layer) in enumerate(zip(self.layers, linears)):
                slots = {}
                for precision, extent in slot_extents[layer_idx].items():
                    slots[precision] = ArenaRange(offset, extent, slot_bytes[layer_idx][precision])
                    offset += extent
                self._slots.append(slots)
                self._fp_regions.append(ArenaRange(offset, self.layer_bytes, self.layer_bytes))
                built = {}
                for kind in SHARDED_KINDS:
                    old = per_layer[kind]
                    lay = layouts[kind]
                    mode = "column" if kind in COLUMN_KINDS else "row"
                    bias = old.bias.data if old.bias is not None else None
                    new = ShardableLinear(lay, mode, self.arena, offset, old.in_features, old.out_features,
                                          old.weight.dtype, bias, packed=packed)
                    held = layers is None or layers[0] <= layer_idx < layers[1]
                    if tp is not None and held:  # None: a worker starting in standby holds no shard
                        new.load(store.get(layer_idx, kind), lay.shard_chunks(tp, rank))  # the host store
                        new.set_shard(tp, rank, group)
                    parent_name, _, attr = names[kind].rpartition(".")
                    setattr(layer.get_submodule(parent_name), attr, new)
                    built[kind] = new
                    offset += lay.nbytes
                self.linears.append(built)
        self.tp, self.rank = tp, rank
        self.num_packed = sum(lin.packed for per_layer in self.linears for lin in per_layer.values())
        self.refresh_fusion()

    # ------------------------------------------------------------------ precision morphing (TP1 only)
    def fp_region(self, layer: int) -> ArenaRange:
        """The contiguous range of the layer's sharded linears: all of it is committed at TP1."""
        return self._fp_regions[layer]

    def slot(self, layer: int, precision: str) -> ArenaRange:
        return self._slots[layer][precision]

    # ------------------------------------------------------------------ accounting
    @property
    def committed_bytes(self) -> int:
        return self.arena.committed_bytes

    def shard_bytes(self, tp: int, rank: int, layers: tuple[int, int] | None = None,
                    kinds: tuple[str, ...] = SHARDED_KINDS, shared: bool = True) -> int:
        """Committed bytes of this worker's weights as shard (tp, rank) of `layers` ([start, end); None: all):
        the replicated part (unless shared=False) and the `kinds` of every held layer."""
        per_layer = 0
        for kind in kinds:
            lay = self.linears[0][kind].layout
            per_layer += sum(lay.chunks[i].nbytes for i in lay.shard_chunks(tp, rank))
        num_layers = self.num_layers if layers is None else max(layers[1] - layers[0], 0)
        return (self.replicated_bytes(layers) if shared else 0) + num_layers * per_layer

    def replicated_bytes(self, *ranges: tuple[int, int] | None) -> int:
        """Bytes of the replicated part a role holding every one of `ranges` of decoder layers keeps (None: all
        layers; no range: what is held now): norms and biases always, the vocabulary tables it reads
        (parallel/stage_tables.py)."""
        return self.rest_bytes + self.tables.held_bytes(self.num_layers, *ranges)

    # ------------------------------------------------------------------ transform
    def switch(self, kinds: tuple[str, ...], tp: int, rank: int, group=None,
               layer_ids: list[int] | None = None) -> tuple[int, int]:
        """Make `kinds` compute as shard (tp, rank), layer by layer, last layer first: load the missing chunks from
        the host store, switch, release the chunks no longer owned. Returns (bytes loaded, bytes released)."""
        loaded = released = 0
        for layer_idx in layer_ids if layer_ids is not None else reversed(range(self.num_layers)):
            for kind in kinds:
                lin = self.linears[layer_idx][kind]
                own = lin.layout.shard_chunks(tp, rank)
                missing = [i for i in own if i not in lin.committed]
                if missing:
                    lin.load(self.store.get(layer_idx, kind), missing)
                    loaded += sum(lin.layout.chunks[i].nbytes for i in missing)
                lin.set_shard(tp, rank, group)
                released += lin.release(sorted(lin.held - set(own)))
        self.refresh_fusion()
        return loaded, released

    def preload(self, tp: int, rank: int, layers: tuple[int, int]) -> int:
        """Commit and fill, from the host store, the chunks shard (tp, rank) of `layers` needs and does not hold,
        and the vocabulary tables it reads, without switching to them (a reshape loads them while the KV migrates,
        ReMP §3.3). Returns bytes loaded."""
        loaded = self.tables.preload(layers, self.num_layers)
        for layer_idx in reversed(range(*layers)):
            for kind, lin in self.linears[layer_idx].items():
                missing = [i for i in lin.layout.shard_chunks(tp, rank) if i not in lin.committed]
                if missing:
                    lin.load(self.store.get(layer_idx, kind), missing)
                    loaded += sum(lin.layout.chunks[i].nbytes for i in missing)
        return loaded

    def release_layers(self, layer_ids) -> int:
        """Give back every chunk of the layers this worker no longer holds (a pipeline stage's foreign layers);
        their linears are deactivated. Returns the bytes released."""
        freed = 0
        for layer_idx in layer_ids:
            for lin in self.linears[layer_idx].values():
                lin.deactivate()
                freed += lin.release(sorted(lin.held))
        self.refresh_fusion()
        return freed

    def release_tables(self, layers: tuple[int, int]) -> int:
        """Give back the vocabulary tables a role of `layers` does not read. Returns the bytes released."""
        return self.tables.release(layers, self.num_layers)

    def set_role(self, tp: int, rank: int, group, layers: tuple[int, int]) -> tuple[int, int]:
        """Hold shard (tp, rank) of exactly the layers [start, end) and the vocabulary tables they read: release
        the others first (their pages can take what is loaded), then load and switch the held ones from the host
        store. Returns (bytes loaded, bytes released)."""
        start, end = layers
        released = self.release_layers(i for i in range(self.num_layers) if not start <= i < end)
        released += self.release_tables(layers)
        loaded, released_in = self.switch(ATTENTION_KINDS + MLP_KINDS, tp, rank, group,
                                          list(reversed(range(start, end))))
        tables_loaded, _ = self.tables.apply(layers, self.num_layers)
        self.tp, self.rank = tp, rank
        return loaded + tables_loaded, released + released_in

    def release_all(self) -> int:
        """Standby: no active shard and every shard chunk given back (embeddings, norms and LM head stay)."""
        freed = 0
        for per_layer in self.linears:
            for lin in per_layer.values():
                lin.deactivate()
                freed += lin.release(sorted(lin.held))
        self.refresh_fusion()
        return freed

    def refresh_fusion(self) -> int:
        """Fuse each layer's q/k/v and gate/up products where their active shards allow it (fuse_shards), unfuse
        them elsewhere; after every shard switch. Returns how many groups are fused."""
        return sum(fuse_shards([per_layer[kind] for kind in kinds]) for per_layer in self.linears
                   for kinds in FUSED_KINDS)

    def set_group(self, group) -> None:
        """Point every row-parallel layer at a new process group object (same ranks, e.g. after a snapshot
        switch)."""
        for per_layer in self.linears:
            for lin in per_layer.values():
                lin.group = group


def weight_gather_plan(old: Topology, new: Topology, layouts: dict[str, PaddedLayout],
                       kept: set[int] = frozenset()) -> list[tuple[int, str, int, int]]:
    """(receiver, kind, chunk, sender) for every chunk a worker's new shard needs and it does not hold when the
    weights phase starts, from a worker that holds it then (a peer of its old instance first). Every worker
    computes the same list. Chunks without a holder are not listed: they come from the host store."""
    def held(worker: int, kind: str) -> set[int]:
        o, n = old.role(worker), new.role(worker)
        if o is None:  # in standby: nothing
            return set()
        scaled_up = n is not None and worker not in kept and n[1] > o[1]
        tp, rank = (n[1], n[2]) if kind in MLP_KINDS and scaled_up else (o[1], o[2])
        return set(layouts[kind].shard_chunks(tp, rank))

    workers = range(max(old.num_workers, new.num_workers))
    plan = []
    for w in workers:
        if w in kept or new.role(w) is None:
            continue
        role = new.role(w)
        tp, rank = role.tp, role.rank
        old_peers = set(old.instances()[old.role(w)[0]]) if old.role(w) is not None else set()
        for kind in SHARDED_KINDS:
            for chunk in layouts[kind].shard_chunks(tp, rank):
                if chunk in held(w, kind):
                    continue
                sources = [p for p in workers if p != w and chunk in held(p, kind)]
                if sources:
                    plan.append((w, kind, chunk, min(sources, key=lambda p: (p not in old_peers, p))))
    return plan


def gather_weights(weights: ShardedWeights, plan: list[tuple[int, str, int, int]], me: int) -> dict:
    """Execute this worker's part of a gather plan, layer by layer from the last; point-to-point only."""
    import torch.distributed as dist

    sent = received = 0
    for layer_idx in reversed(range(weights.num_layers)):
        ops, landed = [], []
        for receiver, kind, chunk, sender in plan:
            lin = weights.linears[layer_idx][kind]
            if receiver == me:
                buf = lin.chunk_buffer(chunk, commit=True)
                ops.append(dist.P2POp(dist.irecv, buf, sender))
                landed.append((lin, chunk))
                received += buf.numel() * buf.element_size()
            elif sender == me:
                buf = lin.plain_chunk(chunk)   # plain rows on the wire: the receiver packs them if it packs
                ops.append(dist.P2POp(dist.isend, buf, receiver))
                sent += buf.numel() * buf.element_size()
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        for lin, chunk in landed:
            lin.mark_loaded(chunk)
    return {"gathered_bytes": received, "sent_bytes": sent}
