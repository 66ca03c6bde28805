"""A greedy step's pick in two small kernels: each row's argmax, and whether all its logits are finite.

After a decode step the engine checks every row's logits for NaN and infinity (its containment of a
hostile adapter: ``LLMEngine._end_non_finite``) and a greedy batch then takes each row's argmax. In torch
that is four launches and two host waits, and torch's argmax reduces a 128k-wide row in one block: 28 us
of a 4.66 ms batch-1 step on an H200 (docs/benchmarks.md, "Fused decoder layers"). Here both answers come
from one pass over the logits that every SM shares, and the engine reads them back in one copy.

``greedy_pick(logits[B, V]) -> int64 [2, B]``: row 0 the token ids, row 1 whether the row is finite (1 or
0), in one tensor so that the engine reads both back in one copy:

- stage 1, grid (B, chunks of ``BLOCK``): each program's chunk maximum (in float32), the first index in
  the chunk that holds it, and how many of its logits are not finite;
- stage 2, grid (B,): the first chunk holding the row's maximum gives the token; the row is finite when
  no chunk counted anything.

Ties go to the lowest index, as ``torch.argmax``'s. A row that is not finite gets a meaningless token id:
the engine ends such a row instead of sampling it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_api.kernels.common import SUPPORTED_DTYPES, device_guard

BLOCK = 2048  # logits per stage-1 program: 63 programs for a 128k vocabulary at batch 1


@triton.jit
def _chunk_kernel(logits_ptr, row_stride, V, chunk_max_ptr, chunk_index_ptr, chunk_bad_ptr, CHUNKS,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x = tl.load(logits_ptr + row * row_stride + offs, mask=mask, other=float("-inf")).to(tl.float32)
    bad = mask & ((x != x) | (tl.abs(x) == float("inf")))
    out = row * CHUNKS + chunk
    tl.store(chunk_max_ptr + out, tl.max(x, axis=0))
    tl.store(chunk_index_ptr + out, chunk * BLOCK + tl.argmax(x, axis=0, tie_break_left=True))
    tl.store(chunk_bad_ptr + out, tl.sum(bad.to(tl.int32), axis=0))


@triton.jit
def _row_kernel(chunk_max_ptr, chunk_index_ptr, chunk_bad_ptr, out_ptr, ROWS, CHUNKS, CHUNKS_POW2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_POW2)
    mask = chunks < CHUNKS
    maxima = tl.load(chunk_max_ptr + row * CHUNKS + chunks, mask=mask, other=float("-inf"))
    best = tl.argmax(maxima, axis=0, tie_break_left=True)
    token = tl.load(chunk_index_ptr + row * CHUNKS + best)
    bad = tl.sum(tl.load(chunk_bad_ptr + row * CHUNKS + chunks, mask=mask, other=0), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))
    tl.store(out_ptr + ROWS + row, (bad == 0).to(tl.int64))


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """[each row's argmax, whether all of the row is finite] (int64 [2, B]) for ``logits`` [B, V] (on CUDA, or
    on CPU under Triton's interpreter: the tests; ``llm_api.engine.sampler.greedy_pick`` chooses between this
    and torch)."""
    if logits.dim() != 2 or logits.dtype not in SUPPORTED_DTYPES or logits.stride(-1) != 1:
        raise ValueError(f"greedy_pick takes logits [rows, vocab] of {SUPPORTED_DTYPES} with unit stride, got "
                         f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}")
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, BLOCK)
    out = torch.empty((2, rows), dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    chunk_max = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    chunk_index = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    chunk_bad = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    with device_guard(logits):
        _chunk_kernel[(rows, chunks)](logits, logits.stride(0), vocab, chunk_max, chunk_index, chunk_bad, chunks,
                                      BLOCK=BLOCK, num_warps=4)
        _row_kernel[(rows,)](chunk_max, chunk_index, chunk_bad, out, rows, chunks,
                             CHUNKS_POW2=triton.next_power_of_2(chunks), num_warps=1)
    return out


def greedy_pick_reference(logits: torch.Tensor) -> torch.Tensor:
    return torch.stack((logits.argmax(dim=-1), torch.isfinite(logits).all(dim=-1).long()))
