"""The one owner of an instance's KV capacity on the control plane (torch-free): its block allocator with reference
counts, the blocks held back for a KV exchange, and every change of the number of attached blocks. Nothing else
creates or changes an allocator (tests/kv/test_kv_ownership.py checks the source):

- the scheduler allocates and frees the blocks of its sequences (`allocate`, `free`, `share`) and parks the blocks
  of a sequence that ended while its KV was still arriving (`hold`, `release_held`);
- precision morphs and parameter drops change the capacity: `grow` adopts blocks the workers of the instance have
  just committed, `shrink` gives up free blocks whose pages the workers then decommit (the resize goes to the
  workers in the same call that changes the pages: morph/executor.py, parallel/worker_exchange.py);
- a reshape takes blocks on a kept instance for requests that move there (`allocate`, `free` on rollback) and gives
  new instances a manager of their own (`KVManager(capacity, block_size)`); a recovered instance starts afresh
  (`reset`).

Block ids are the slots of the workers' page pools (kv/page_pool.py): every worker of an instance holds the same
ids for its own heads and layers."""
from __future__ import annotations

from elastic_hf.kv.block_allocator import BlockAllocator, NoFreeBlocksError
from elastic_hf.units import ceil_div

__all__ = ["KVManager", "NoFreeBlocksError"]


class KVManager:
    def __init__(self, num_blocks: int, block_size: int):
        """Blocks 0 .. num_blocks - 1 attached (what the workers' pools commit at start), `block_size` tokens each."""
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"need num_blocks >= 0 and block_size >= 1, got {num_blocks} and {block_size}")
        self.block_size = block_size
        self._allocator = BlockAllocator(range(num_blocks))
        # Blocks of sequences that ended while a KV exchange still writes into them: free once it is over.
        self._held: list[int] = []
        self.num_grown = 0       # blocks attached / detached by resizes since start (cumulative)
        self.num_shrunk = 0

    # ------------------------------------------------------------------ what an observer reads
    @property
    def num_total(self) -> int:
        return self._allocator.num_total

    @property
    def num_free(self) -> int:
        return self._allocator.num_free

    @property
    def num_used(self) -> int:
        return self._allocator.num_used

    @property
    def num_held(self) -> int:
        return len(self._held)

    def can_allocate(self, num_blocks: int) -> bool:
        return self._allocator.can_allocate(num_blocks)

    def is_attached(self, block_id: int) -> bool:
        return self._allocator.is_attached(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._allocator.ref_count(block_id)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    def blocks_to_grow(self, num_held_blocks: int, num_tokens: int) -> int:
        """Blocks a holder of `num_held_blocks` must still get to hold `num_tokens` tokens."""
        return max(0, self.blocks_for_tokens(num_tokens) - num_held_blocks)

    # ------------------------------------------------------------------ blocks of sequences
    def allocate(self, num_blocks: int) -> list[int]:
        """Raises NoFreeBlocksError ("need 12 blocks, 3 free of 64") when they are not there."""
        return self._allocator.allocate(num_blocks)

    def free(self, block_ids: list[int]) -> None:
        self._allocator.free(block_ids)

    def share(self, block_ids: list[int]) -> None:
        """Another holder of blocks in use (their KV is reused, not copied)."""
        self._allocator.share(block_ids)

    def hold(self, block_ids: list[int]) -> None:
        """Keep the blocks of a sequence that ended during a KV exchange out of circulation until it is over."""
        self._held.extend(block_ids)

    def release_held(self) -> int:
        """The exchange is over (done or lost): held blocks go back. Returns how many."""
        held, self._held = self._held, []
        self._allocator.free(held)
        return len(held)

    # ------------------------------------------------------------------ capacity
    def grow(self, block_ids: list[int]) -> None:
        """Blocks every worker of the instance has just committed become allocatable."""
        self._allocator.attach(block_ids)
        self.num_grown += len(block_ids)

    def shrink(self, num_blocks: int) -> list[int]:
        """Give up to `num_blocks` free blocks (never live ones, highest ids first, so the pools shrink from their
        tail); the caller hands the returned ids to the workers, which decommit their pages."""
        block_ids = self._allocator.detach_free(num_blocks)
        self.num_shrunk += len(block_ids)
        return block_ids

    def shrink_to(self, num_blocks: int) -> list[int]:
        """Shrink until at most `num_blocks` are attached (free blocks only); returns the ids given up."""
        return self.shrink(max(0, self.num_total - num_blocks))

    def reset(self, num_blocks: int) -> None:
        """Start over with blocks 0 .. num_blocks - 1 (a worker of the instance was replaced and its pool made
        anew). No block may be in use: the instance's sequences were preempted first."""
        if self.num_used - len(self._held) > 0:
            raise RuntimeError(f"{self.num_used - len(self._held)} KV blocks are still in use; preempt their "
                               f"sequences before resetting the KV manager")
        self._allocator = BlockAllocator(range(num_blocks))
        self._held = []
