"""ElasticModel: a Hugging Face causal LM served by the elastic-hf engine, with its weights and KV pages in
budgeted arenas. `generate`, `chat` and `stream` drive the engine in the calling thread; the server drives the
same engine from its own thread through AsyncEngine."""
from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from elastic_hf.engine.llm_engine import LLMEngine
from elastic_hf.engine.metrics import EngineMetrics
from elastic_hf.engine.outputs import RequestOutput
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.engine.scheduler import Scheduler, SchedulerConfig
from elastic_hf.kv.layout import KVLayout
from elastic_hf.kv.page_pool import KVPagePool
from elastic_hf.kv.paged_attention import register_paged_attention
from elastic_hf.layers.cpu_gemm import use_onednn_linears
from elastic_hf.memory import (MemoryBudget, create_arena, default_page_size, device_total_bytes, format_bytes,
                               parse_memory_budget)
from elastic_hf.model.loader import load_hf_model, parse_dtype, resolve_model
from elastic_hf.model.runner import ModelRunner
from elastic_hf.model.weight_placement import place_weights, weights_capacity_bytes
from elastic_hf.morph.builder import MorphOptions, prepare_morph
from elastic_hf.patches import get_adapter

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # KV bytes when no memory budget is given


@dataclass(slots=True)
class EngineOptions:
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv_cache_memory: int | None = None   # KV bytes when memory_budget is None
    page_size: int | None = None         # arena page; None = backend default

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")


class ElasticModel:
    def __init__(self, hf_model, tokenizer, engine: LLMEngine, *, model_id: str, budget: MemoryBudget,
                 weights_arena, kv_pool: KVPagePool, placement, adapter, checkpoint_dir, morph=None):
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.engine = engine
        self.model_id = model_id
        self.budget = budget
        self.weights_arena = weights_arena
        self.kv_pool = kv_pool
        self.placement = placement
        self.adapter = adapter
        self.checkpoint_dir = checkpoint_dir
        self.morph = morph  # MorphManager (morph.to_precision, morph.state) or None when morph="off"
        self._request_counter = itertools.count()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike | None = None, *, dtype: str | torch.dtype | None = None,
                        memory_budget: int | float | str | None = None, max_model_len: int | None = None,
                        device: str | torch.device = "cpu", morph: str = "off", profile: str | None = None,
                        morph_options: dict | None = None, **options) -> "ElasticModel":
        """Load a local HF checkpoint dir, a .gguf file, or (None) the embedded SmolLM2-135M-Instruct.

        memory_budget caps the bytes committed in this instance's arenas (weights + KV): bytes, "2GiB", or a
        fraction of the device ("0.5"). Without it, the KV cache gets `kv_cache_memory` bytes (default 1 GiB).
        options: block_size, max_num_seqs, max_num_batched_tokens, kv_cache_memory, page_size.
        morph: "off", "manual" (only model.morph.to_precision), or a controller mode "accuracy" | "default" |
        "performance"; profile: LIS profile JSON for the swap order; morph_options: MorphOptions fields
        (variants=VariantConfig fields, controller=ControllerConfig overrides)."""
        engine_options = EngineOptions(**options)
        morph_opts = MorphOptions(mode=morph, profile=profile, **(morph_options or {}))
        device = torch.device(device)
        torch_dtype = parse_dtype(dtype)
        attn_implementation = register_paged_attention()
        resolved = resolve_model(name_or_path)
        hf_model, tokenizer = load_hf_model(resolved.checkpoint_dir, torch_dtype, attn_implementation)
        adapter = get_adapter(hf_model.config)
        config = hf_model.config
        hf_model.to(device)
        layers = adapter.decoder_layers(hf_model)
        morph_setup = prepare_morph(morph_opts, hf_model, adapter, layers, tokenizer, resolved.checkpoint_dir,
                                    resolved.model_id) if morph_opts.enabled else None
        slot_bytes = morph_setup.store.slot_bytes() if morph_setup else None

        # Page size and the two arenas. The budget ledger is shared: a morph moves bytes from one to the other.
        page_size = engine_options.page_size or default_page_size(device)
        weight_bytes = weights_capacity_bytes(hf_model, layers, page_size)  # committed at load
        # Quant slots are reserved address space; the headroom keeps one slot's bytes free so a morph can start.
        arena_bytes = weights_capacity_bytes(hf_model, layers, page_size, slot_bytes)
        headroom = morph_setup.headroom_bytes(page_size) if morph_setup else 0
        num_heads, num_kv_heads, head_dim = adapter.head_counts(config)
        layout = KVLayout(config.num_hidden_layers, num_kv_heads, head_dim, engine_options.block_size,
                          torch_dtype, page_size)
        if memory_budget is None:
            kv_bytes = engine_options.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
            budget_bytes = weight_bytes + kv_bytes + headroom
        else:
            budget_bytes = parse_memory_budget(memory_budget, device_total_bytes(device))
        kv_bytes = budget_bytes - weight_bytes - headroom
        num_blocks = kv_bytes // layout.block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"memory_budget={format_bytes(budget_bytes)} leaves {format_bytes(max(kv_bytes, 0))} for the KV "
                f"cache after {format_bytes(weight_bytes)} of weights; one KV block needs "
                f"{format_bytes(layout.block_bytes)}")
        budget = MemoryBudget(budget_bytes)
        weights_arena = create_arena(device, arena_bytes, budget, "weights", page_size, huge_pages=True)
        placement = place_weights(hf_model, layers, weights_arena, slot_bytes)
        # The KV arena reserves room for the whole budget: morphs may hand it every byte weights give up.
        max_blocks = budget_bytes // layout.block_bytes
        kv_arena = create_arena(device, max_blocks * layout.block_bytes, budget, "kv", page_size)
        kv_pool = KVPagePool(layout, kv_arena, max_blocks, num_blocks)

        kv_tokens = num_blocks * layout.block_size
        limit = getattr(config, "max_position_embeddings", None) or kv_tokens
        if max_model_len is None:
            max_model_len = min(limit, kv_tokens, 8192)
        elif not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {max_model_len}")
        elif max_model_len > kv_tokens:
            raise ValueError(f"max_model_len={max_model_len} tokens does not fit the KV cache: {num_blocks} blocks "
                             f"x {layout.block_size} tokens = {kv_tokens} tokens under memory_budget="
                             f"{format_bytes(budget_bytes)}")

        scheduler = Scheduler(SchedulerConfig(engine_options.max_num_seqs, engine_options.max_num_batched_tokens,
                                              engine_options.block_size), kv_pool.allocator)
        use_onednn_linears(hf_model)  # after any calibration, so profiles and AWQ scales do not depend on it
        runner = ModelRunner(hf_model, kv_pool, getattr(config, "sliding_window", None))
        eos = hf_model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
            eos_ids.append(tokenizer.eos_token_id)
        engine = LLMEngine(runner, scheduler, tokenizer, model_id=resolved.model_id, max_model_len=max_model_len,
                           vocab_size=config.vocab_size, eos_token_ids=eos_ids,
                           metrics=EngineMetrics(resolved.model_id))
        manager = morph_setup.finish(engine, layers, weights_arena, placement, kv_pool, budget, device) \
            if morph_setup else None
        log.info("loaded %s: weights %s, KV %d blocks x %d tokens (%s), max_model_len %d", resolved.model_id,
                 format_bytes(placement.committed_bytes), num_blocks, layout.block_size,
                 format_bytes(kv_pool.committed_bytes), max_model_len)
        return cls(hf_model, tokenizer, engine, model_id=resolved.model_id, budget=budget,
                   weights_arena=weights_arena, kv_pool=kv_pool, placement=placement, adapter=adapter,
                   checkpoint_dir=resolved.checkpoint_dir, morph=manager)

    # ------------------------------------------------------------------ generation
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def _params(self, sampling_params: SamplingParams | None, sampling: dict) -> SamplingParams:
        if sampling_params is not None:
            if sampling:
                raise ValueError(f"pass either sampling_params or keyword options, not both: {sorted(sampling)}")
            return sampling_params
        # Offline calls default to greedy like HF generate; the server uses OpenAI's defaults.
        return SamplingParams(**{"temperature": 0.0, **sampling})

    def _submit(self, prompt: str | list[int], params: SamplingParams) -> str:
        request_id = f"offline-{next(self._request_counter)}"
        self.engine.add_request(request_id, prompt, params)
        return request_id

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        try:
            while len(results) < len(request_ids):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return [results[r] for r in request_ids]

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | None = None, **sampling) -> RequestOutput | list[RequestOutput]:
        """Complete one prompt (-> RequestOutput) or a list (-> list). Prompts are text or token ids.
        Sampling keywords: see SamplingParams (default here: greedy)."""
        params = self._params(sampling_params, sampling)
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        request_ids: list[str] = []
        try:
            for prompt in batch:
                request_ids.append(self._submit(prompt, params))
        except ValueError:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        outputs = self._run(request_ids)
        return outputs[0] if single else outputs

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers may hand back a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             **sampling) -> RequestOutput | list[RequestOutput]:
        """One conversation (list of {"role", "content"}) or a list of them, through the model's chat template."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        outputs = self.generate(prompts, sampling_params, **sampling) if len(prompts) > 1 else \
            [self.generate(prompts[0], sampling_params, **sampling)]
        return outputs[0] if single else outputs

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
               **sampling) -> Iterator[RequestOutput]:
        """Yields a RequestOutput whenever new text is ready (see delta_text); the last one has finished=True."""
        params = self._params(sampling_params, sampling)
        request_id = self._submit(prompt, params)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort_request(request_id)

    # ------------------------------------------------------------------ memory
    def memory_report(self) -> dict:
        """Committed bytes per owner from the budget ledger, plus KV block counts."""
        ledger = self.budget.report()
        allocator = self.kv_pool.allocator
        return {
            "budget_bytes": self.budget.total_bytes,
            "weights_bytes": self.budget.used_bytes("weights"),
            "kv_bytes": self.budget.used_bytes("kv"),
            "free_bytes": self.budget.free_bytes,
            "kv_block_bytes": self.kv_pool.layout.block_bytes,
            "kv_block_size": self.kv_pool.layout.block_size,
            "kv_blocks_total": allocator.num_total,
            "kv_blocks_used": allocator.num_used,
            "kv_blocks_free": allocator.num_free,
            "ledger": ledger,
            **({"layer_store": self.morph.swapper.store.report()} if self.morph is not None else {}),
        }
