"""Head-centric KV page layout (AMOEBA §3.1, Gyges §4.1).

One KV block holds `block_size` tokens of every layer:

    arena block  = [num_layers, num_kv_heads, 2 (K/V), block_size, head_dim]
    per layer    = [block, kv_head, K/V, token, head_dim]

Keeping a KV head's tokens contiguous inside a block means a head range of a block is one contiguous byte range
per layer: a reshape moves or frees whole head ranges without touching the others.

A pipeline stage holds only its own layers [first_layer, first_layer + num_layers): model layer l sits at local
layer l - first_layer, and a block is that much smaller.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic_hf.units import round_up


def block_page_span(block_id: int, block_bytes: int, page_size: int) -> tuple[int, int]:
    """[first, end) pages of an arena of `page_size` pages that block `block_id` of `block_bytes` bytes touches
    (blocks smaller than a page share pages: KVLayout.block_bytes)."""
    start = block_id * block_bytes
    return start // page_size, -(-(start + block_bytes) // page_size)


def block_pages(block_ids, block_bytes: int, page_size: int) -> set[int]:
    """The arena pages that blocks `block_ids` touch (blocks smaller than a page share pages)."""
    return {p for b in block_ids for p in range(*block_page_span(b, block_bytes, page_size))}


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    page_size: int
    first_layer: int = 0   # model index of the first layer held (a pipeline stage's layer_start)

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.first_layer < 0:
            raise ValueError(f"first_layer must be >= 0, got {self.first_layer}")

    def local_layer(self, layer_idx: int) -> int:
        """Index of model layer `layer_idx` inside a block."""
        local = layer_idx - self.first_layer
        if not 0 <= local < self.num_layers:
            raise ValueError(f"layer {layer_idx} is not held here: this KV cache holds layers "
                             f"{self.first_layer}..{self.first_layer + self.num_layers - 1}")
        return local

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def layer_numel(self) -> int:
        return self.num_kv_heads * 2 * self.block_size * self.head_dim

    @property
    def block_payload_bytes(self) -> int:
        return self.num_layers * self.layer_numel * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes between consecutive blocks in the arena: the payload rounded to whole chunks (one [block_size,
        head_dim] K or V slab) so the arena can be indexed as one [chunks, block_size, head_dim] tensor (and so also
        as [rows, head_dim]). Blocks are not padded to pages: where a block is smaller than a page (a 2 MiB CUDA VMM
        page holds 5.7 blocks of the default model in bf16) neighbouring blocks share pages, which KVPagePool
        commits while any block on them is attached, instead of each block taking whole pages of its own (82 % of
        the default model's KV memory on a GPU went to padding that way)."""
        return round_up(self.block_payload_bytes, self.chunk_bytes)

    def page_span(self, block_id: int) -> tuple[int, int]:
        """[first, end) arena pages that block `block_id` touches."""
        return block_page_span(block_id, self.block_bytes, self.page_size)

    def blocks_within(self, nbytes: int) -> int:
        """How many blocks, laid out from block 0, fit in `nbytes` of whole pages."""
        return max(nbytes, 0) // self.page_size * self.page_size // self.block_bytes

    def bytes_for_blocks(self, num_blocks: int) -> int:
        """Committed bytes of blocks 0 .. num_blocks - 1: whole pages."""
        return round_up(num_blocks * self.block_bytes, self.page_size)

    @property
    def chunk_bytes(self) -> int:
        """One (layer, kv head, K or V) slab of a block: [block_size, head_dim], contiguous."""
        return self.block_size * self.head_dim * self.itemsize

    @property
    def chunks_per_block(self) -> int:
        return self.block_bytes // self.chunk_bytes

    @property
    def chunks_per_layer(self) -> int:
        return self.num_kv_heads * 2

    @property
    def rows_per_block(self) -> int:
        """head_dim-sized rows per arena block."""
        return self.block_numel // self.head_dim

    @property
    def rows_per_layer(self) -> int:
        return self.num_kv_heads * 2 * self.block_size

    @property
    def block_numel(self) -> int:
        return self.block_bytes // self.itemsize
