"""The data plane of precision morphing on one worker (MorphServe §4.3-4.4): the layer store, the swapper and the
worker's share of KV resizing, driven by `MorphCommand`s from the control plane's MorphManager.

Who decides what: the instance's KV manager owns the block ids and the pool's size, so only it knows which KV blocks
are free and only it resizes the pool (kv/kv_manager.py, through the worker's `resize_kv`). The worker reports what
the budget could still give the KV cache beyond the headroom (`spare_blocks`: the manager grows by them) and, when a
swap waits for bytes the budget does not have, how many it needs: the manager shrinks by free blocks and the next
command finds the room."""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from elastic_hf.config import MorphConfig
from elastic_hf.morph.copier import make_copier
from elastic_hf.morph.layer_store import LayerStore
from elastic_hf.morph.layer_swapper import LayerSwapper, SwapCounters, SwapRecord


@dataclass(slots=True)
class MorphCommand:
    requests: list[tuple[list[int], str]] = field(default_factory=list)   # (layers, precision) to swap to
    wait_copies: bool = False            # block until started copies finish (offline driving, no forward runs)


@dataclass(slots=True)
class MorphReport:
    precisions: list[str]                # what each layer runs now
    targets: list[str]                   # what each layer will run once its pending swap is done
    pending_layers: list[int]
    busy: bool                           # swaps queued, copying or waiting for room
    in_flight: bool                      # copies running
    room_needed_bytes: int               # > 0: a swap waits for this many more free budget bytes
    records: list[SwapRecord]            # swaps switched by this command
    spare_blocks: int                    # KV blocks the budget holds beyond the headroom now (the manager grows)
    counters: SwapCounters
    weights_committed_bytes: int
    kv_committed_bytes: int
    kv_blocks: int
    budget_bytes: int
    budget_free_bytes: int
    headroom_bytes: int


@dataclass(frozen=True, slots=True)
class MorphInfo:
    """What the control plane needs once, at start: layer count, precisions, and the KV blocks a layer gives the
    cache when it moves from fp to each precision (the controller's restore projection)."""
    num_layers: int
    precisions: tuple[str, ...]
    blocks_per_layer: dict[str, int]
    block_bytes: int
    host_store: dict


def prepare_layer_store(config: MorphConfig, hf_model: nn.Module, adapter, layers: nn.ModuleList, checkpoint_dir,
                        model_id: str) -> LayerStore:
    """Build (or load from the cache) every layer's quantized variants before the weights are placed: their sizes
    shape the weights arena (one reserved slot per precision and layer)."""
    if adapter.morph_refusal:
        raise ValueError(f"precision morphing cannot quantize this model's layers: {adapter.morph_refusal}")
    if config.method == "awq" and adapter.awq_refusal:
        raise ValueError(f"morph calibration (AWQ) is not available for {adapter.model_types[0]}: "
                         f"{adapter.awq_refusal}; leave calib_path unset for RTN variants")
    return LayerStore.build(hf_model, adapter, layers, config, checkpoint_dir, model_id)


class MorphExecutor:
    def __init__(self, store: LayerStore, layers: nn.ModuleList, weights, budget, headroom_bytes: int, device,
                 pool_of):
        """weights: the worker's PlacedWeights / ShardedWeights (already placed with quant slots); pool_of(): the
        worker's KV pool now (it may be replaced by a reshape)."""
        store.bind(weights.arena, weights)
        self.store = store
        self.budget = budget
        self.headroom_bytes = headroom_bytes
        self.weights = weights
        self._pool_of = pool_of
        self._room_needed = 0
        self.swapper = LayerSwapper(layers, store, weights.arena, weights, make_copier(device), self._has_room)

    @property
    def pool(self):
        return self._pool_of()

    def info(self) -> MorphInfo:
        pool = self.pool
        block_bytes = pool.layout.block_bytes
        gained = {}
        for precision in self.store.precisions[1:]:
            freed = [self.weights.fp_region(i).nbytes - self.weights.slot(i, precision).nbytes
                     for i in range(self.store.num_layers)]
            gained[precision] = sum(freed) // len(freed) // block_bytes
        return MorphInfo(self.store.num_layers, self.store.precisions, gained, block_bytes, self.store.report())

    def _has_room(self, nbytes: int, keep_headroom: bool, returned_at_switch: int) -> bool:
        # the headroom is the largest quantized slot, so headroom - returned >= 0 and nbytes always fits
        reserve = max(0, self.headroom_bytes - returned_at_switch) if keep_headroom else 0
        missing = nbytes + reserve - self.budget.free_bytes
        if missing > 0:
            self._room_needed = max(self._room_needed, missing)
        return missing <= 0

    def _spare_blocks(self) -> int:
        """KV blocks the budget allows beyond the headroom, up to the pool's reserved slots."""
        return self.pool.attachable_within(self.budget.free_bytes - self.headroom_bytes)

    def sync(self, command: MorphCommand) -> MorphReport:
        """Apply a command at a step boundary (no forward pass runs): queue the swaps, switch the layers whose copy
        finished, start queued ones that fit, and report the room left for KV blocks."""
        swapper = self.swapper
        for layers, precision in command.requests:
            for layer in layers:
                swapper.request(layer, precision)
        if command.wait_copies:
            swapper.wait_copies()
        self._room_needed = 0
        records = swapper.poll()
        spare = 0 if swapper.waiting_for_room else self._spare_blocks()   # a waiting swap gets the room first
        pool = self.pool
        return MorphReport(
            precisions=list(swapper.precision), targets=[swapper.target(i) for i in range(self.store.num_layers)],
            pending_layers=swapper.pending_layers(), busy=swapper.busy, in_flight=bool(swapper.in_flight()),
            room_needed_bytes=self._room_needed, records=records, spare_blocks=spare,
            counters=swapper.counters, weights_committed_bytes=self.weights.arena.committed_bytes,
            kv_committed_bytes=pool.committed_bytes, kv_blocks=pool.num_blocks, budget_bytes=self.budget.total_bytes,
            budget_free_bytes=self.budget.free_bytes, headroom_bytes=self.headroom_bytes)

    def all_full_precision(self) -> bool:
        return not self.swapper.busy and all(p == "fp" for p in self.swapper.precision)
