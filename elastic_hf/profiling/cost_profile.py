"""Measuring micro-batch forwards for the eq. 1-3 cost model (KunServe §4.3: "we run multiple inference samples
offline, collect their execution times, and then use the least squares method"). The forwards run on the real data
plane of one worker: the model instance with its weights in the arena, its KV page pool and `ModelRunner.execute`
over `SeqStepInput`s, exactly as a serving step runs them. Only the timing matters, so a chunk's prefix is
whatever its freshly allocated KV blocks hold and its token ids are arbitrary."""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path

import torch

from elastic_hf.config import EngineConfig
from elastic_hf.engine.cost_model import Chunk, Sample
from elastic_hf.engine.step_plan import SeqStepInput
from elastic_hf.kv.kv_manager import KVManager
from elastic_hf.kv.layout import KVLayout
from elastic_hf.memory import default_page_size
from elastic_hf.model.instance import build_instance, load_model, worker_device
from elastic_hf.model.weight_placement import PlacedWeights
from elastic_hf.units import ceil_div


@dataclass(frozen=True, slots=True)
class Grid:
    """The profiled micro-batches: `batch_sizes` chunks of every (prefix, chunk) pair; batches of decodes at every
    decode prefix; and one chunk plus decodes (a chunked-prefill step). Together they vary the attention work,
    the tokens, the chunks per micro-batch and the sampled rows independently, which the fit needs."""
    prefixes: tuple[int, ...]
    chunks: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    decode_prefixes: tuple[int, ...]
    decode_batches: tuple[int, ...]
    max_tokens: int      # new tokens of one micro-batch at most (a step's token budget)
    head_rows: tuple[int, ...] = (1, 4, 16, 64)   # rows the head part is timed at alone (MicroBatchTimer.run_head)


GRIDS = {
    "small": Grid(prefixes=(0, 48), chunks=(8, 32), batch_sizes=(1, 3), decode_prefixes=(16, 96),
                  decode_batches=(1, 6), max_tokens=128),
    "full": Grid(prefixes=(0, 256, 1024), chunks=(16, 64, 256), batch_sizes=(1, 2, 4),
                 decode_prefixes=(64, 512, 1024), decode_batches=(1, 8, 16), max_tokens=1024,
                 head_rows=(1, 8, 32, 128)),
}


def grid_micro_batches(grid: Grid, max_positions: int) -> list[list[Chunk]]:
    """Every micro-batch of `grid` whose sequences fit `max_positions` (the model's context) and whose new tokens
    fit grid.max_tokens. Prefill chunks sample on every other (prefix, chunk) pair, so sampled rows do not simply
    follow the chunk count."""
    out = []
    for (i, prefix), (j, tokens), n in product(enumerate(grid.prefixes), enumerate(grid.chunks), grid.batch_sizes):
        if prefix + tokens <= max_positions and n * tokens <= grid.max_tokens:
            out.append([Chunk(prefix, tokens, (i + j) % 2 == 0)] * n)
    for prefix, n in product(grid.decode_prefixes, grid.decode_batches):
        if prefix + 1 <= max_positions:
            out.append([Chunk(prefix, 1, True)] * n)
    decodes = [Chunk(p, 1, True) for p in grid.decode_prefixes if p + 1 <= max_positions]
    for prefix, tokens in product(grid.prefixes, grid.chunks):
        if prefix + tokens <= max_positions and tokens + len(decodes) <= grid.max_tokens:
            out.append([Chunk(prefix, tokens, False), *decodes])
    return out


class MicroBatchTimer:
    """One worker's model instance (model/instance.py, as a single-worker deployment builds it) with a KV pool
    for `max_blocks` blocks; `time(chunks)` is the median seconds of `repeats` forwards after `warmup` ones."""

    def __init__(self, checkpoint_dir: str | Path, dtype: str = "float32", device: str = "cpu",
                 max_blocks: int = 256, block_size: int = 16):
        config = EngineConfig(dtype=dtype, device=device, block_size=block_size)
        loaded = load_model(checkpoint_dir, config.dtype, worker_device(config, 0))
        layout = KVLayout(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, block_size, loaded.dtype,
                          config.page_size or default_page_size(loaded.device))
        config = replace(config, kv_cache_memory=layout.bytes_for_blocks(max_blocks))
        self.instance = build_instance(config, loaded, lambda budget, page: PlacedWeights.place(
            loaded.hf_model, loaded.layers, budget, loaded.device, page))
        self.instance.set_pool(self.instance.new_pool(1, 0, max_blocks))
        self.kv = KVManager(max_blocks, block_size)
        self.block_size = block_size
        self.num_layers = loaded.num_layers
        self.max_positions = int(getattr(loaded.hf_config, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(loaded.hf_config.vocab_size)
        self.hidden_size = int(loaded.hf_config.hidden_size)
        self.dtype = loaded.dtype
        self.device = loaded.device
        self.rng = random.Random(0)

    @staticmethod
    def blocks_for(chunks: list[Chunk], block_size: int = 16) -> int:
        """KV blocks a micro-batch holds: every chunk's prefix and new tokens."""
        return sum(ceil_div(c.prefix + c.tokens, block_size) for c in chunks)

    def run_once(self, chunks: list[Chunk]) -> float:
        """Seconds of one forward of the micro-batch on fresh KV blocks (freed after)."""
        needed = self.blocks_for(chunks, self.block_size)
        if needed > self.kv.num_total:
            raise ValueError(f"a micro-batch of {len(chunks)} chunks needs {needed} KV blocks; the timer holds "
                             f"{self.kv.num_total}")
        inputs = [SeqStepInput([self.rng.randrange(self.vocab_size) for _ in range(c.tokens)], c.prefix,
                               self.kv.allocate(self.kv.blocks_for_tokens(c.prefix + c.tokens)), c.sampled)
                  for c in chunks]
        try:
            started = time.perf_counter()
            self.instance.runner.execute(inputs)   # [sampled rows, vocab]
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return time.perf_counter() - started
        finally:
            for seq in inputs:
                self.kv.free(seq.block_ids)

    @torch.inference_mode()
    def run_head(self, rows: int) -> float:
        """Seconds of the head part alone on `rows` sampled rows: the final norm and the LM head over hidden states
        [1, rows, hidden], logits in fp32, as the last stage's forward ends (model/runner.py)."""
        model = self.instance.runner.model
        hidden = torch.randn(1, rows, self.hidden_size, dtype=self.dtype, device=self.device)   # [1, rows, hidden]
        started = time.perf_counter()
        logits = model.lm_head(model.get_decoder().norm(hidden)).float()                        # [1, rows, vocab]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - started
        del logits
        return elapsed

    def time(self, chunks: list[Chunk], repeats: int = 3, warmup: int = 1) -> float:
        """Median seconds of `repeats` forwards after `warmup` untimed ones."""
        for _ in range(warmup):
            self.run_once(chunks)
        return statistics.median(self.run_once(chunks) for _ in range(repeats))


def measure(timer: MicroBatchTimer, micro_batches: list[list[Chunk]], repeats: int = 3, warmup: int = 1,
            progress: bool = True, desc: str = "forwards") -> list[Sample]:
    """(micro-batch, median seconds) of each, in order. The forwards run in rounds over all micro-batches (warm-up
    rounds first): a burst of other load on the machine then spreads over many micro-batches, one run each, which
    the median drops, instead of slowing every run of one micro-batch and skewing the fit there."""
    from tqdm.auto import tqdm

    runs: list[list[float]] = [[] for _ in micro_batches]
    with tqdm(total=(warmup + repeats) * len(micro_batches), desc=desc, unit="fwd", disable=not progress) as bar:
        for round_index in range(warmup + repeats):
            for i, chunks in enumerate(micro_batches):
                seconds = timer.run_once(chunks)
                if round_index >= warmup:
                    runs[i].append(seconds)
                bar.update()
    return [(chunks, statistics.median(seconds)) for chunks, seconds in zip(micro_batches, runs)]


def measure_head(timer: MicroBatchTimer, rows: tuple[int, ...], repeats: int = 3, warmup: int = 1
                 ) -> list[tuple[int, float]]:
    """(rows, median seconds) of the head part alone at each row count, in rounds as `measure` runs them."""
    runs: dict[int, list[float]] = {r: [] for r in rows}
    for round_index in range(warmup + repeats):
        for r in rows:
            seconds = timer.run_head(r)
            if round_index >= warmup:
                runs[r].append(seconds)
    return [(r, statistics.median(seconds)) for r, seconds in runs.items()]
