"""The one assembly of a worker's model instance: the HF model (its own modeling code, with the paged attention
registered), its weights placed in an arena, the memory budget, the KV pool and the runner.

A worker builds it in three moves (parallel/worker.py): `load_model`, then anything that must see the plain model
before its weights move (precision morphing builds its layer variants there), then `build_instance` with the weight
layout of its kind: model/weight_placement.PlacedWeights for a single worker, parallel/shard_transform.ShardedWeights
for a worker that can change its tensor-parallel degree."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from elastic_hf.config import EngineConfig
from elastic_hf.kv.layout import KVLayout
from elastic_hf.kv.migration_plan import head_range
from elastic_hf.kv.page_pool import KVPagePool
from elastic_hf.kv.attention_backends import LayerAttention, choose_attention_backend
from elastic_hf.kv.paged_attention import register_paged_attention
from elastic_hf.layers.cpu_gemm import use_onednn_linears
from elastic_hf.layers.fused_decoder_layer import use_fused_layers
from elastic_hf.layers.native_norm import use_native_norms
from elastic_hf.layers.native_rotary import use_native_rotary
from elastic_hf.layers.packed_linear import packing_available, packs_in_place_instead
from elastic_hf.layers.packed_table import pack_head_in_place
from elastic_hf.layers.swiglu_mlp import use_swiglu_mlps
from elastic_hf.memory import MemoryBudget, create_arena, default_page_size, device_total_bytes
from elastic_hf.memory.host_malloc import tune_host_malloc
from elastic_hf.native.argmax import native_argmax_available
from elastic_hf.model.awq_checkpoint import awq_quantization, load_awq_model
from elastic_hf.model.loader import parse_dtype
from elastic_hf.model.cuda_graph_runner import CudaGraphRunner
from elastic_hf.model.runner import ModelRunner
from elastic_hf.model.weight_placement import PlacedWeights, WeightLayout
from elastic_hf.patches import ArchAdapter, get_adapter
from elastic_hf.units import format_bytes, parse_memory_budget, round_up

log = logging.getLogger(__name__)

_UNSIZED_BUDGET = 1 << 62   # while weights are placed; sized right after, once their bytes are known


@dataclass(slots=True, eq=False)
class LoadedModel:
    hf_model: nn.Module
    adapter: ArchAdapter
    layers: nn.ModuleList
    dtype: torch.dtype
    device: torch.device
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_attention: LayerAttention = LayerAttention()

    @property
    def hf_config(self):
        return self.hf_model.config

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def worker_device(config: EngineConfig, worker_id: int) -> torch.device:
    """cpu, or cuda:i for worker i (wrapping around the visible GPUs)."""
    device = torch.device(config.device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", worker_id % max(torch.cuda.device_count(), 1))
    return device


def load_model(checkpoint_dir: str | Path, dtype: torch.dtype | str, device: torch.device,
               trust_remote_code: bool = False) -> LoadedModel:
    """The HF model of a checkpoint in eval mode, on `device`, running our paged attention."""
    from transformers import AutoModelForCausalLM

    attn = register_paged_attention()
    awq = awq_quantization(checkpoint_dir)
    if awq is not None:   # pre-quantized: W4 layers straight from the file
        hf_model = load_awq_model(checkpoint_dir, parse_dtype(dtype), attn, trust_remote_code)
    else:
        hf_model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=parse_dtype(dtype),
                                                        attn_implementation=attn, trust_remote_code=trust_remote_code
                                                        ).eval().requires_grad_(False)
    hf_model.to(device)
    adapter = get_adapter(hf_model.config).located_in(hf_model)
    layers = adapter.decoder_layers(hf_model)
    adapter = adapter.checked_against(layers[0])
    num_heads, num_kv_heads, head_dim = adapter.head_counts(hf_model.config)
    layer_attention = LayerAttention(tuple(adapter.layer_windows(hf_model.config, layers)),
                                     adapter.attention_softcap(hf_model.config))
    return LoadedModel(hf_model, adapter, layers, parse_dtype(dtype), device, num_heads, num_kv_heads, head_dim,
                       layer_attention)


@dataclass(slots=True, eq=False)
class ModelInstance:
    """One worker's data plane. weights: PlacedWeights or ShardedWeights (committed_bytes, shard_bytes(tp, rank),
    fp_region(layer), slot(layer, precision), arena: the WeightLayout protocol)."""
    loaded: LoadedModel
    weights: WeightLayout
    budget: MemoryBudget
    page_size: int
    block_size: int
    headroom_bytes: int        # kept uncommitted so a precision swap can always start (0 without morphing)
    runner: ModelRunner | CudaGraphRunner
    pool: KVPagePool | None = None

    @property
    def hf_model(self) -> nn.Module:
        return self.loaded.hf_model

    def kv_layout(self, tp: int, rank: int, layers: tuple[int, int] | None = None) -> KVLayout:
        """KV blocks of shard (tp, rank): the shard's KV-head range of every layer it holds ([start, end); None:
        all, a pipeline stage holds its own)."""
        lo, hi = head_range(self.loaded.num_kv_heads, tp, rank)
        start, end = layers if layers is not None else (0, self.loaded.num_layers)
        return KVLayout(end - start, hi - lo, self.loaded.head_dim, self.block_size, self.loaded.dtype,
                        self.page_size, start)

    def kv_capacity(self, tp: int, rank: int, layers: tuple[int, int] | None = None) -> int:
        """KV blocks this worker can hold as shard (tp, rank) of `layers` once its weights are that shard."""
        free = self.budget.total_bytes - self.weights.shard_bytes(tp, rank, layers) - self.headroom_bytes
        return self.kv_layout(tp, rank, layers).blocks_within(free)

    def new_pool(self, tp: int, rank: int, num_blocks: int, layers: tuple[int, int] | None = None) -> KVPagePool:
        """A KV pool for shard (tp, rank) of `layers` with `num_blocks` blocks attached; its arena reserves room for
        the whole budget, since morphs may hand the KV cache every byte the weights give up."""
        layout = self.kv_layout(tp, rank, layers)
        max_blocks = layout.blocks_within(self.budget.total_bytes)
        if num_blocks > max_blocks:
            raise ValueError(f"{num_blocks} KV blocks exceed the {max_blocks} that fit the worker's budget of "
                             f"{format_bytes(self.budget.total_bytes)}")
        arena = create_arena(self.loaded.device, max_blocks * layout.block_bytes, self.budget, "kv", self.page_size)
        try:
            return KVPagePool(layout, arena, max_blocks, num_blocks)
        except BaseException:
            arena.close()
            raise

    def set_pool(self, pool: KVPagePool | None) -> None:
        self.pool = pool
        self.runner.pool = pool


WeightsFactory = Callable[[MemoryBudget, int], WeightLayout]   # (budget, page_size) -> placed weights


def use_fused_forward(config: EngineConfig, adapter, layers, device: torch.device) -> int:
    """Switch Llama-formula decoder layers to the fused forward (layers/fused_decoder_layer.py) where the config
    allows it (fused_layers auto: on the CPU; on: every device). Returns how many."""
    if config.fused_layers == "off" or (config.fused_layers == "auto" and device.type != "cpu"):
        return 0
    return use_fused_layers(layers, adapter.modeling_module, adapter.rotary_function)


def use_layer_kernels(config: EngineConfig, adapter, layers, device: torch.device) -> None:
    """The native norms and the fused forward for decoder layers built after the instance (precision morphing's
    quantized variants, deep copies of the layers as loaded), so a morphed layer runs the paths its fp one does."""
    if adapter.rms_norm_class is not None:
        use_native_norms(adapter.layer_norm_modules(layers), adapter.rms_norm_class)
    use_fused_forward(config, adapter, layers, device)


def build_instance(config: EngineConfig, loaded: LoadedModel, place_weights: WeightsFactory, *,
                   headroom_bytes: int = 0) -> ModelInstance:
    """Place the weights, size the worker's budget and make the runner. The KV pool comes later (`new_pool`):
    how many blocks a worker holds depends on its role in the deployment's topology.

    The budget is `memory_budget` when given, else the worker's TP1 weights + `kv_cache_memory` + the headroom."""
    device = loaded.device
    if device.type == "cpu":
        tune_host_malloc()   # activations reuse freed heap memory instead of faulting it in every step
        native_argmax_available()   # greedy sampling's kernel, built now rather than in the first step
    page_size = config.page_size or default_page_size(device)
    budget = MemoryBudget(_UNSIZED_BUDGET)
    weights = place_weights(budget, page_size)
    loaded.hf_model.to(device)  # buffers (rotary tables) follow the arena-resident parameters
    # After any calibration (profiles and AWQ scales must not depend on the GEMM backend): oneDNN fp32 linears,
    # and prepacked weights where they never change after load (their bytes count before the KV is sized).
    use_onednn_linears(loaded.hf_model)
    # (A TP / pipeline worker's sharded linears packed their chunks in place as they were placed.)
    placed_whole = isinstance(weights, PlacedWeights)
    groups = loaded.adapter.fusion_groups(loaded.layers) if config.packs_weights and placed_whole else []
    if groups and device.type == "cpu" and packing_available():
        if config.morph.enabled:
            # The decoder layers' bytes are swapped in and out of their arena ranges: packed there, in place (the
            # morph store captures their fp images afterwards); the rest (the LM head) never changes.
            num_in_place = weights.pack_layers_in_place(loaded.layers, groups)
            log.info("%d decoder-layer linears on packed weights in their own arena bytes (precision morphing)",
                     num_in_place)
            num_packed = weights.pack_linears(loaded.hf_model, exclude=loaded.layers)
        else:
            num_packed = weights.pack_linears(loaded.hf_model, groups)
        if packs_in_place_instead(loaded.dtype):
            # bf16 on a CPU where oneDNN packs no bf16 (no AVX-512) and ATen's bf16 GEMM reads ~0.5 GB/s of weights
            # at 32 rows: every linear our kernel reads goes on its layout in its own arena bytes instead, the head
            # too (a tied embedding then reads its rows there).
            if not config.morph.enabled:
                num_packed += weights.pack_layers_in_place(loaded.layers, groups)
            num_packed += int(pack_head_in_place(loaded.hf_model))
        log.info("%d linears on packed weights (%s beyond the plain weights: tied tables)", num_packed,
                 format_bytes(weights.packed_extra_bytes))
    elif config.packed_weights == "on" and device.type == "cpu" and placed_whole:
        raise ValueError("packed_weights='on' needs oneDNN's weight reorder (torch.ops.mkldnn) and "
                         "ELASTIC_HF_CPU_GEMM unset or 'onednn'")
    if config.packs_weights and device.type == "cpu" and not placed_whole and pack_head_in_place(loaded.hf_model):
        log.info("the LM head (with its tied embedding table) on packed bytes in place")
    # What packing did not take (CUDA; bf16 on a CPU whose oneDNN cannot pack it) still runs q/k/v and gate/up as
    # one GEMM each, over a view of their back-to-back bytes.
    num_stacked = weights.stack_linears(groups) if groups else 0
    if num_stacked:
        log.info("%d groups of linears (q/k/v, gate/up) run as one GEMM each over their stacked weights",
                 num_stacked)
    # The elementwise work around the GEMMs in single passes (C on the CPU, Triton on CUDA): every RMSNorm, the
    # MLPs' silu(gate) * up (on the CPU straight from the gate/up product just fused), and the rotary embedding.
    adapter = loaded.adapter
    num_norms = 0 if adapter.rms_norm_class is None else use_native_norms(
        adapter.norms(loaded.hf_model, loaded.layers), adapter.rms_norm_class)
    num_mlps = use_swiglu_mlps(adapter.mlps(loaded.layers), getattr(loaded.hf_config, "hidden_act", None), device)
    rotary = adapter.rotary_function is not None and use_native_rotary(adapter.modeling_module,
                                                                       adapter.rotary_function, device)
    if num_norms or num_mlps or rotary:
        log.info("%d RMSNorms and %d MLPs on native fused kernels; rotary embedding %s", num_norms, num_mlps,
                 "native" if rotary else "eager")
    num_fused = use_fused_forward(config, adapter, loaded.layers, device)
    if num_fused:
        log.info("%d of %d decoder layers on the fused forward", num_fused, len(loaded.layers))
    tp1_bytes = weights.shard_bytes(1, 0)
    if config.memory_budget is None:
        # whole pages: the KV arena commits pages (2 MiB on CUDA), which neighbouring blocks share
        total = tp1_bytes + round_up(config.kv_bytes_per_worker, page_size) + headroom_bytes
    else:
        total = parse_memory_budget(config.memory_budget, device_total_bytes(device))
    attention = choose_attention_backend(device, loaded.dtype, loaded.head_dim, config.block_size)
    log.info("attention backend: %s", attention.name)
    runner = ModelRunner(loaded.hf_model, None, attention, loaded.layer_attention,
                         adapter.stage_input_scale)
    if device.type == "cuda" and not config.enforce_eager:
        if not loaded.layer_attention.is_uniform:
            log.info("CUDA graphs are off: this model's layers attend differently (windows %s, soft-cap %s)",
                     loaded.layer_attention.distinct_windows, loaded.layer_attention.softcap)
        elif config.num_workers > 1:
            log.info("CUDA graphs are off in a deployment of %d worker processes: their steps run eagerly",
                     config.num_workers)
        elif attention.name != "triton":
            log.warning("CUDA graphs need Triton's paged KV kernels (Triton installed; power-of-two head_dim and "
                        "block_size, here %d and %d): decode steps run eagerly", loaded.head_dim, config.block_size)
        else:
            runner = CudaGraphRunner.capture_decodes(runner, loaded.layers, config.max_num_seqs)
    instance = ModelInstance(loaded, weights, budget, page_size, config.block_size, headroom_bytes, runner)
    block_bytes = instance.kv_layout(1, 0).bytes_for_blocks(1)   # one block: whole pages
    kv_bytes = total - tp1_bytes - headroom_bytes
    if kv_bytes < block_bytes:  # a TP1 instance of this worker must hold at least one KV block
        raise ValueError(f"memory_budget={format_bytes(total)} leaves {format_bytes(max(kv_bytes, 0))} for the KV "
                         f"cache after {format_bytes(tp1_bytes)} of weights"
                         + (f" and {format_bytes(headroom_bytes)} of morph headroom" if headroom_bytes else "")
                         + f"; one KV block needs {format_bytes(block_bytes)} (whole {format_bytes(page_size)} "
                         f"pages of the {device.type} arena)")
    budget.total_bytes = total
    return instance
