"""Automatic prefix caching (vLLM's APC; SGLang's radix cache in block form), torch-free: a full KV block is named
by a chained hash of what its KV depends on (the hash of the block before it, its token ids, and for the first
block the cache salt of the request), so one lookup walks a prompt's blocks from the start and stops at the first
block no one has computed. The names do not depend on the instance: a router can hash a prompt once and ask every
instance how much of it is cached.

The cache lives in an instance's KVManager (kv/kv_manager.py): a computed full block is registered under its hash;
when its last holder frees it, it stays cached and allocatable, last in line (least recently freed first), and a
lookup that finds it takes it back at no cost. Allocation that reaches a cached block evicts it (forgets its hash).

Epochs: the KV of a block depends on the weights that computed it. A precision morph changes them, so it starts a
new epoch (`KVManager.reset_prefix_cache`): every name is forgotten, and sequences admitted in an older epoch
register nothing more (their later blocks attend to KV of the old weights); only sequences admitted since fill the
cache again."""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable

from elastic_hf.config import PREFIX_CACHING_HASH_ALGOS

BlockHash = bytes | int


def hash_function(algo: str) -> Callable[[BlockHash | None, list[int], bytes], BlockHash]:
    """(parent hash or None, the block's token ids, extra bytes of the first block) -> the block's hash.
    sha256 (vLLM's default): collisions are out of reach; builtin: Python's tuple hash, faster, 64 bits."""
    if algo == "sha256":
        def sha256(parent, token_ids, extra):
            h = hashlib.sha256(parent if parent is not None else extra)
            h.update(array("q", token_ids).tobytes())
            return h.digest()
        return sha256
    if algo == "builtin":
        def builtin(parent, token_ids, extra):
            return hash((parent if parent is not None else extra, tuple(token_ids)))
        return builtin
    raise ValueError(f"prefix_caching_hash_algo must be one of {PREFIX_CACHING_HASH_ALGOS}, got {algo!r}")


def first_block_extra(cache_salt: str | None) -> bytes:
    """What the first block's hash mixes in besides its tokens: requests with different salts never share KV
    (vLLM's cache_salt, for tenant isolation)."""
    return b"salt\x00" + (cache_salt or "").encode()


def extend_block_hashes(hashes: list[BlockHash], token_ids: list[int], block_size: int, num_blocks: int,
                        hash_fn: Callable, cache_salt: str | None) -> list[BlockHash]:
    """Extend `hashes` (the chain of the first len(hashes) full blocks of `token_ids`) to `num_blocks` blocks, in
    place; returns it."""
    if len(hashes) < num_blocks:
        extra = first_block_extra(cache_salt)
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = hash_fn(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
            hashes.append(parent)
    return hashes


def prompt_lookup_hashes(token_ids: list[int], block_size: int, hash_fn: Callable,
                         cache_salt: str | None) -> list[BlockHash]:
    """The hashes a lookup of this prompt walks: every full block but never the last token (its logits are needed,
    so it is always computed)."""
    return extend_block_hashes([], token_ids, block_size, (len(token_ids) - 1) // block_size, hash_fn, cache_salt)


class PrefixCache:
    """Hash <-> block id maps of one instance's computed full blocks."""

    def __init__(self, algo: str = "sha256"):
        self.hash = hash_function(algo)
        self.epoch = 0
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self.num_queried_tokens = 0    # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.num_hit_tokens = 0        # of them, found computed (prefix_cache_hits)

    def __len__(self) -> int:
        return len(self._block_of)

    def count_lookups(self, queried_tokens: int, hit_tokens: int) -> None:
        self.num_queried_tokens += queried_tokens
        self.num_hit_tokens += hit_tokens

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def lookup(self, hashes: list[BlockHash]) -> list[int]:
        """Block ids of the longest prefix of `hashes` that is cached."""
        found = []
        for h in hashes:
            block_id = self._block_of.get(h)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Name a just-computed full block. False when the hash already names another block (two sequences
        computed the same prefix at once: the first one stays the cached copy) or the block already has a name."""
        if block_hash in self._block_of or block_id in self._hash_of:
            return False
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def forget(self, block_ids) -> None:
        """These blocks are overwritten or leave the pools: their hashes name nothing any more."""
        for block_id in block_ids:
            block_hash = self._hash_of.pop(block_id, None)
            if block_hash is not None:
                del self._block_of[block_hash]

    def new_epoch(self) -> int:
        """Forget every hash (the KV was computed by weights that no longer run); returns how many there were."""
        dropped = len(self._block_of)
        self._block_of.clear()
        self._hash_of.clear()
        self.epoch += 1
        return dropped
