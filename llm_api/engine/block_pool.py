"""Fixed-size KV blocks: allocation, reference counts and the prefix cache (pure Python, no torch).

The pool owns ``num_blocks`` block ids. A block is either held (``ref_count`` > 0, by one or more
requests) or free. Free blocks sit in an LRU queue; allocation takes the least recently freed one.
A FULL block can carry a content hash chained over (parent block hash, its token ids), so equal hashes
mean equal token prefixes. Hashed blocks are kept in ``cached_block_ids`` while held and after they are
freed, until the block is taken for other content (evicted). A request whose prompt starts with the
same blocks takes them with ``touch`` (ref count + 1) instead of recomputing their K/V.

A block whose contents are not finite (written by a request the engine ended for non-finite logits) is
*tainted*: ``taint`` drops it from the prefix cache at once, and when its last holder frees it, it joins
``blocks_to_zero`` instead of being reused as it is: the engine zeroes those blocks' K/V before the next
forward, since a reused block's unwritten slots are read (masked) by attention, and a masked NaN still
turns the sum into NaN.

``check_invariants(holders)`` verifies that free + held == total and that every ref count equals the
number of holders; tests call it after every operation.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterable, Mapping, Sequence


class NoFreeBlocksError(RuntimeError):
    """Asked for more blocks than are free; callers check ``num_free_blocks`` first."""


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Content hash of one full block, chained over its parent's hash (128-bit, collision-safe)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash or b"root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._tainted: set[int] = set()  # held blocks with non-finite contents (module docstring)
        self.blocks_to_zero: list[int] = []  # freed tainted blocks, to zero before their next use
        self.block_hash_of: list[bytes | None] = [None] * num_blocks
        # Free block ids in LRU order (the first is evicted first); values unused.
        self._free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_block_ids: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this content, held or free, or None."""
        if not self.enable_prefix_caching:
            return None
        return self.cached_block_ids.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit); free ones leave the free queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free_queue[block_id]
            self.ref_counts[block_id] += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (ref count 1), evicting their old cached content."""
        if num_blocks > len(self._free_queue):
            raise NoFreeBlocksError(f"need {num_blocks} blocks, {len(self._free_queue)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block. Give a request's blocks in order: the tail is evicted first."""
        # Reversed, so a request's last blocks (least likely shared) are the first to be reused.
        for block_id in reversed(block_ids):
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self._free_queue[block_id] = None
                if block_id in self._tainted:
                    self._tainted.discard(block_id)
                    self.blocks_to_zero.append(block_id)

    def taint(self, block_ids: Iterable[int]) -> None:
        """Mark held blocks as holding non-finite K/V: out of the prefix cache now, zeroed once freed."""
        for block_id in block_ids:
            self._evict(block_id)
            self._tainted.add(block_id)

    def take_blocks_to_zero(self) -> list[int]:
        taken, self.blocks_to_zero = self.blocks_to_zero, []
        return taken

    def cache_full_block(self, block_id: int, block_hash: bytes) -> None:
        """Record that a held, full block contains the tokens ``block_hash`` stands for."""
        if not self.enable_prefix_caching or self.block_hash_of[block_id] is not None:
            return
        if block_hash in self.cached_block_ids:
            return  # the same content already lives in another block; keep that one as the cached copy
        self.block_hash_of[block_id] = block_hash
        self.cached_block_ids[block_hash] = block_id

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash_of[block_id]
        if block_hash is not None:
            self.block_hash_of[block_id] = None
            del self.cached_block_ids[block_hash]

    def check_invariants(self, holders: Mapping[str, Sequence[int]]) -> None:
        """Raise AssertionError unless the pool agrees with ``holders`` (holder id -> its block ids)."""
        expected = [0] * self.num_blocks
        for block_ids in holders.values():
            for block_id in block_ids:
                expected[block_id] += 1
        assert expected == self.ref_counts, "ref counts differ from the number of holders"
        free = set(self._free_queue)
        held = {i for i, count in enumerate(self.ref_counts) if count > 0}
        assert not free & held, f"blocks both free and held: {sorted(free & held)[:10]}"
        assert len(free) + len(held) == self.num_blocks, "free + held != total"
        for block_hash, block_id in self.cached_block_ids.items():
            assert self.block_hash_of[block_id] == block_hash, f"cache index disagrees for block {block_id}"
        assert sum(h is not None for h in self.block_hash_of) == len(self.cached_block_ids)
