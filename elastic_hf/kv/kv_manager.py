"""The one owner of an instance's KV capacity (torch-free): its block allocator with reference counts, the blocks
held back for a KV exchange, and the size of the instance's page pools. Nothing else creates or changes an
allocator, and nothing else resizes a serving pool (tests/test_ownership.py checks the source):

- the scheduler allocates and frees the blocks of its sequences (`allocate`, `free`, `share`) and parks the blocks
  of a sequence that ended while its KV was still arriving (`hold`, `release_held`);
- precision morphs and parameter drops change the capacity: `grow(n)` has every worker of the instance commit n
  more blocks and makes their ids allocatable, `shrink(n)` gives up free blocks and has the workers decommit them;
  a recovered instance starts afresh (`reset`). Each is one `KVResize` sent through the pool channel the deployment
  binds (`bind_pools`): the allocator changes only with the pools' answer, so the two never disagree between
  steps. Resizes happen at step boundaries (a morph's swap needs its room at the boundary it starts at, and an
  idle instance runs no step to carry them);
- a reshape takes blocks on a kept instance for requests that move there (`allocate`, `free` on rollback) and plans
  new instances on managers of their own at their capacity (`KVManager(capacity, block_size)`); a parameter drop's
  commit leaves their pools with only the moved blocks while the old pools still hold the rest of the budget, and
  `limit_to_pools` drops what they did not commit before the first step.

Block ids are the slots of the workers' page pools (kv/page_pool.py): every worker of an instance holds the same
ids for its own heads and layers."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from elastic_hf.kv.block_allocator import BlockAllocator, NoFreeBlocksError
from elastic_hf.kv.prefix_cache import BlockHash, PrefixCache
from elastic_hf.units import ceil_div

__all__ = ["KVManager", "KVResize", "NoFreeBlocksError"]


@dataclass(slots=True)
class KVResize:
    """One change of the page pools of an instance, applied by every worker of it (parallel/worker.py resize_kv)."""
    attach: int = 0                                            # commit this many more blocks, lowest free slots
    detach_block_ids: list[int] = field(default_factory=list)  # decommit these (free: the manager gave them up)
    reset_to: int | None = None                                # hold exactly blocks 0 .. reset_to - 1


# Applies a KVResize on every worker of the instance; returns each worker's newly attached block ids.
PoolChannel = Callable[[KVResize], list[list[int]]]


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, pools: PoolChannel | None = None,
                 prefix_cache: PrefixCache | None = None):
        """Blocks 0 .. num_blocks - 1 attached (what the workers' pools commit at start), `block_size` tokens each.
        pools: the channel to the instance's page pools (None: a manager whose capacity never changes, such as a
        unit test's or a reshape's plan before its instance exists; `bind_pools` binds one later).
        prefix_cache: computed full blocks stay findable by their hash after their sequences free them
        (kv/prefix_cache.py); None: prefix caching off."""
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"need num_blocks >= 0 and block_size >= 1, got {num_blocks} and {block_size}")
        self.block_size = block_size
        self._allocator = BlockAllocator(range(num_blocks))
        self._pools = pools
        self.prefix_cache = prefix_cache
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
        """Raises NoFreeBlocksError ("need 12 blocks, 3 free of 64") when they are not there. Cached free blocks
        are taken last, and taking one evicts it from the prefix cache."""
        block_ids = self._allocator.allocate(num_blocks)
        if self.prefix_cache is not None:
            self.prefix_cache.forget(block_ids)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """A block whose last holder leaves stays cached (allocatable, last in line) when the prefix cache names
        it."""
        cache = self.prefix_cache
        self._allocator.free(block_ids, cache.is_cached if cache is not None else None)

    def share(self, block_ids: list[int]) -> None:
        """Another holder of blocks in use (their KV is reused, not copied)."""
        self._allocator.share(block_ids)

    def hold(self, block_ids: list[int]) -> None:
        """Keep the blocks of a sequence that ended during a KV exchange out of circulation until it is over."""
        self._held.extend(block_ids)

    # ------------------------------------------------------------------ prefix cache
    @property
    def cache_epoch(self) -> int | None:
        """The prefix cache's epoch (None: caching off); a sequence whose hash chain began in another epoch neither
        finds nor registers blocks."""
        return self.prefix_cache.epoch if self.prefix_cache is not None else None

    @property
    def num_cached_free(self) -> int:
        return self._allocator.num_cached_free

    def lookup_prefix(self, hashes: list[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of a sequence's full-block hashes (nothing is taken yet)."""
        return self.prefix_cache.lookup(hashes) if self.prefix_cache is not None else []

    def take_cached(self, block_ids: list[int]) -> None:
        """A sequence holds these cached blocks from now on (in use by others or cached free)."""
        self._allocator.acquire(block_ids)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """A sequence just computed this full block (it holds it): findable under `block_hash` from now on."""
        if self.prefix_cache is not None:
            self.prefix_cache.register(block_id, block_hash)

    def reset_prefix_cache(self) -> int:
        """A new cache epoch: every hash is forgotten and cached free blocks become plain free ones (a precision
        morph changed the weights that computed them; POST /reset_prefix_cache). Returns how many were named."""
        if self.prefix_cache is None:
            return 0
        self._allocator.uncache_all()
        return self.prefix_cache.new_epoch()

    def release_held(self) -> int:
        """The exchange is over (done or lost): held blocks go back. Returns how many."""
        held, self._held = self._held, []
        self._allocator.free(held)
        return len(held)

    # ------------------------------------------------------------------ capacity
    def bind_pools(self, pools: PoolChannel) -> None:
        """The channel to the page pools of the instance this manager now serves (the deployment binds it when the
        instance is built)."""
        self._pools = pools

    def _resize_pools(self, resize: KVResize) -> list[int]:
        if self._pools is None:
            raise RuntimeError(f"this KV manager ({self.num_total} blocks) has no page pools bound: its capacity "
                               f"cannot change")
        attached = self._pools(resize)
        # After a reset every pool holds blocks 0 .. n-1, each having filled its own gaps.
        if resize.reset_to is None and any(ids != attached[0] for ids in attached):
            raise RuntimeError(f"the workers of one instance attached different KV blocks: "
                               f"{[ids[:4] for ids in attached]}")
        return attached[0]

    def grow(self, num_blocks: int) -> list[int]:
        """Every worker of the instance commits `num_blocks` more blocks; their ids become allocatable. Returns
        them."""
        if num_blocks <= 0:
            return []
        block_ids = self._resize_pools(KVResize(attach=num_blocks))
        self._allocator.attach(block_ids)
        self.num_grown += len(block_ids)
        return block_ids

    def shrink(self, num_blocks: int) -> list[int]:
        """Give up to `num_blocks` free blocks (never live ones, highest ids first, so the pools shrink from their
        tail); every worker decommits their pages before this returns. Returns the ids given up."""
        block_ids = self._allocator.detach_free(num_blocks)
        if block_ids:
            try:
                self._resize_pools(KVResize(detach_block_ids=block_ids))
            except BaseException:
                self._allocator.attach(block_ids)   # the pools kept them (a failed worker is recovered anyway)
                raise
            self._forget(block_ids)
            self.num_shrunk += len(block_ids)
        return block_ids

    def _forget(self, block_ids: list[int]) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.forget(block_ids)

    def shrink_to(self, num_blocks: int) -> list[int]:
        """Shrink until at most `num_blocks` are attached (free blocks only); returns the ids given up."""
        return self.shrink(max(0, self.num_total - num_blocks))

    def limit_to_pools(self, num_committed: int) -> None:
        """A reshape planned this manager at its instance's capacity, and a deferred-KV commit left the new pools
        with only blocks 0 .. num_committed - 1 (the moved KV's): drop the free blocks beyond them, which no pool
        holds, before the instance's first step."""
        self._forget(self._allocator.detach_from(num_committed))

    def reset(self, num_blocks: int) -> None:
        """Start over with blocks 0 .. num_blocks - 1 on the manager and every pool of the instance (a worker of it
        was replaced and its pool made anew; the survivors' pools may hold other blocks after morphs or an
        interrupted exchange). No block may be in use: the instance's sequences were preempted first."""
        if self.num_used - len(self._held) > 0:
            raise RuntimeError(f"{self.num_used - len(self._held)} KV blocks are still in use; preempt their "
                               f"sequences before resetting the KV manager")
        self._resize_pools(KVResize(reset_to=num_blocks))
        self._allocator = BlockAllocator(range(num_blocks))
        self._held = []
        if self.prefix_cache is not None:   # the replaced worker's pages are gone, and with them the cached KV
            self.prefix_cache.new_epoch()
