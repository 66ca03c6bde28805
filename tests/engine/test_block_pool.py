"""The block pool: allocation, reference counts, the prefix cache, under seeded random operations (no torch)."""

from __future__ import annotations

import random

import pytest

from llm_api.engine.block_pool import BlockPool, NoFreeBlocksError, hash_block

BLOCK_SIZE = 4


class _PoolUser:
    """Plays requests against a bare BlockPool: each holder has tokens and blocks; full blocks are cached
    and ``content`` remembers what every block holds, so a cache hit can be checked for correctness."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.holders: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.content: dict[int, tuple[int, ...]] = {}

    def hashes(self, tokens: list[int]) -> list[bytes]:
        out: list[bytes] = []
        for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
            out.append(hash_block(out[-1] if out else None, tokens[start : start + BLOCK_SIZE]))
        return out

    def add(self, name: str, tokens: list[int]) -> bool:
        hits = []
        for block_hash in self.hashes(tokens)[: (len(tokens) - 1) // BLOCK_SIZE]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            expected = tuple(tokens[len(hits) * BLOCK_SIZE : (len(hits) + 1) * BLOCK_SIZE])
            assert self.content[block_id] == expected, "a cache hit returned a block with other tokens"
            hits.append(block_id)
        num_new = -(-len(tokens) // BLOCK_SIZE) - len(hits)
        if num_new + sum(self.pool.ref_counts[b] == 0 for b in hits) > self.pool.num_free_blocks:
            return False
        self.pool.touch(hits)
        self.holders[name] = hits + self.pool.allocate(num_new)
        self.tokens[name] = list(tokens)
        self._write_and_cache(name, first_block=len(hits))
        return True

    def append(self, name: str, new_tokens: list[int]) -> bool:
        tokens = self.tokens[name] + new_tokens
        num_new = -(-len(tokens) // BLOCK_SIZE) - len(self.holders[name])
        if num_new > self.pool.num_free_blocks:
            return False
        first_block = len(self.tokens[name]) // BLOCK_SIZE  # the partly filled block gets written again
        self.holders[name] += self.pool.allocate(num_new)
        self.tokens[name] = tokens
        self._write_and_cache(name, first_block)
        return True

    def release(self, name: str) -> None:
        self.pool.free(self.holders.pop(name))
        del self.tokens[name]

    def _write_and_cache(self, name: str, first_block: int) -> None:
        tokens, blocks = self.tokens[name], self.holders[name]
        hashes = self.hashes(tokens)
        for i in range(first_block, len(blocks)):
            chunk = tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            if self.pool.ref_counts[blocks[i]] == 1 or self.content.get(blocks[i]) == chunk:
                self.content[blocks[i]] = chunk
            else:  # a shared block is never rewritten: shared blocks are full and cached
                raise AssertionError(f"would overwrite shared block {blocks[i]}")
            if i < len(hashes):
                self.pool.cache_full_block(blocks[i], hashes[i])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_block_pool_operations_keep_invariants(seed):
    rng = random.Random(seed)
    pool = BlockPool(num_blocks=64, block_size=BLOCK_SIZE)
    user = _PoolUser(pool)
    system_prompts = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    num_hits = 0
    preempted: dict[str, list[int]] = {}
    for step in range(3000):
        op = rng.choice(["add", "share", "append", "free", "abort", "preempt", "resume"])
        names = list(user.holders)
        if op in ("add", "share"):
            prefix = rng.choice(system_prompts) if op == "share" else []
            tokens = prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            before = pool.num_free_blocks
            user.add(f"r{step}", tokens)
            num_hits += op == "share" and f"r{step}" in user.holders and before - pool.num_free_blocks < -(-len(tokens) // BLOCK_SIZE)
        elif op == "append" and names:
            user.append(rng.choice(names), [rng.randrange(50) for _ in range(rng.randrange(1, 6))])
        elif op in ("free", "abort") and names:
            user.release(rng.choice(names))
        elif op == "preempt" and names:
            name = rng.choice(names)
            preempted[name] = user.tokens[name]
            user.release(name)
        elif op == "resume" and preempted:
            name = rng.choice(list(preempted))
            if user.add(name, preempted[name]):
                del preempted[name]
        pool.check_invariants(user.holders)
    assert num_hits > 50, "the workload should exercise prefix sharing"
    for name in list(user.holders):
        user.release(name)
    pool.check_invariants({})
    assert pool.num_free_blocks == pool.num_blocks


def test_pool_refuses_and_detects_double_free():
    pool = BlockPool(num_blocks=2, block_size=BLOCK_SIZE)
    blocks = pool.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(blocks[:1])
