"""A sequence's KV blocks as the scheduler hands them out (pure Python, no torch): ``SequenceBlocks``.

Over one ``BlockPool`` (``llm_api.engine.block_pool``: allocation, reference counts, the prefix cache), for
one sequence (``Request``) at a time:

* ``find_cached_blocks``: at admission, the full blocks of its tokens already in the prefix cache (hashes
  chained from its ``prefix_salt``, so a request under a LoRA adapter reuses only that adapter's blocks),
  never the block of its last token (its logits give the next token); none when the pool caches no
  prefixes, the request does not use the cache, or it needs the prompt's logits or hidden states (every
  position computed);
* ``blocks_to_take`` / ``allocate_slots``: the blocks for its next tokens after those hits. ``allocate_slots``
  takes all or nothing (False: too few are free, and the caller preempts or waits), and gives a sequence
  about to write into a block another sequence holds (n > 1: the prompt's partial last block) a block of
  its own, the pair recorded in ``copies`` for the model runner (copy on write);
* ``cache_full_blocks``: registers its blocks full of computed tokens in the prefix cache (a drafted
  sequence's count only its accepted tokens);
* ``release``: gives its blocks back (preempted, finished or aborted) and forgets what it had computed, so a
  resumed sequence recomputes.

Whom to preempt or what to leave waiting when blocks run short is the scheduler's (``llm_api.engine.scheduler``,
``llm_api.engine.precedence``): this module only counts and takes.
"""

from __future__ import annotations

from typing import Sequence

from llm_api.engine.block_pool import BlockPool, hash_block
from llm_api.engine.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SequenceBlocks:
    def __init__(self, block_pool: BlockPool):
        self.block_pool = block_pool
        self.block_size = block_pool.block_size

    def find_cached_blocks(self, request: Request) -> list[int]:
        if (not (self.block_pool.enable_prefix_caching and request.uses_prefix_cache) or request.needs_prompt_logits
                or request.needs_prompt_hidden):
            return []
        self._extend_block_hashes(request)
        # Keep at least the last token to compute: its logits give the next token.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_block_ids = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block_id = self.block_pool.lookup(block_hash)
            if block_id is None:
                break
            hit_block_ids.append(block_id)
        return hit_block_ids

    def _extend_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < request.num_tokens // bs:
            start = len(hashes) * bs
            hashes.append(hash_block(hashes[-1] if hashes else request.prefix_salt, request.token_ids(start, start + bs)))

    def blocks_to_take(self, request: Request, num_new_tokens: int, hit_block_ids: Sequence[int]) -> tuple[int, int]:
        """(new blocks to allocate, cached hit blocks now in the free queue) for ``num_new_tokens`` more tokens
        of the request after ``hit_block_ids``: both come out of the free blocks."""
        num_computed = request.num_computed_tokens + len(hit_block_ids) * self.block_size
        num_needed = _cdiv(num_computed + num_new_tokens, self.block_size) - len(request.block_ids) - len(hit_block_ids)
        # Hit blocks that nobody holds are in the free queue: taking them leaves fewer to allocate.
        return num_needed, sum(1 for b in hit_block_ids if self.block_pool.ref_counts[b] == 0)

    def allocate_slots(self, request: Request, num_new_tokens: int, hit_block_ids: Sequence[int] = (),
                       copies: list[tuple[int, int]] | None = None) -> bool:
        """Give the request enough blocks for ``num_new_tokens`` more tokens; False if too few are free.
        A running request about to write into a block it shares gets a copy of it (``copies``)."""
        pool = self.block_pool
        num_needed, num_hits_from_free = self.blocks_to_take(request, num_new_tokens, hit_block_ids)
        copy_tail = copies is not None and self.writes_shared_block(request)
        if num_needed + num_hits_from_free + copy_tail > pool.num_free_blocks:
            return False
        if copy_tail:
            assert copies is not None  # (copy_tail is False without it)
            shared = request.block_ids[-1]
            request.block_ids[-1] = pool.allocate(1)[0]
            pool.free([shared])  # (still held by the other sharers)
            copies.append((shared, request.block_ids[-1]))
        pool.touch(hit_block_ids)
        request.block_ids.extend(hit_block_ids)
        if num_needed > 0:
            request.block_ids.extend(pool.allocate(num_needed))
        return True

    def writes_shared_block(self, request: Request) -> bool:
        """The next token's K/V go into the request's last block, and another sequence holds it too. (Only
        a forked prompt's blocks are shared, and a sequence holds no blocks past them until it decodes,
        so the block written next is the last one whenever it is shared, drafts included.)"""
        return (request.num_computed_tokens % self.block_size != 0 and bool(request.block_ids)
                and self.block_pool.ref_counts[request.block_ids[-1]] > 1)

    def cache_full_blocks(self, request: Request) -> None:
        num_full_blocks = request.num_computed_tokens // self.block_size
        if not request.uses_prefix_cache or num_full_blocks <= request.num_cached_blocks:
            return
        self._extend_block_hashes(request)
        for i in range(request.num_cached_blocks, num_full_blocks):
            self.block_pool.cache_full_block(request.block_ids[i], request.block_hashes[i])
        request.num_cached_blocks = num_full_blocks

    def release(self, request: Request) -> None:
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_cached_blocks = 0
