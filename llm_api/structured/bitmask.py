"""Token masks: their format, and applying one to a step's logits. What the sampler uses of structured output.

Contract
- A mask is int32 ``[batch, ceil(V / 32)]`` on the CPU (bit ``t % 32`` of word ``t // 32`` set: token
  ``t`` allowed), made by ``allocate_bitmask`` with every token allowed and filled by the matchers
  (``llm_api.structured.matcher``).
- ``TokenMask`` is one step's mask as the engine hands it to the sampler: the bitmask and the rows it
  applies to (rows whose matcher allows every token are not listed, and cost nothing).
- ``apply_bitmask(logits, bitmask, rows)`` sets the disallowed logits of the listed rows to -inf in
  place, row ``r`` of the mask going with row ``r`` of the logits; other rows are not read or written,
  and an empty ``rows`` costs nothing. Apply it after penalties and before temperature / top-k / top-p,
  so that sampling only ever sees allowed tokens. ``apply_bitmask_reference`` is the same in plain torch
  (the slow path the tests compare against).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from llm_api.structured.library import load_xgrammar

__all__ = ["TokenMask", "allocate_bitmask", "apply_bitmask", "apply_bitmask_reference"]


@dataclass(frozen=True)
class TokenMask:
    """One step's token mask: ``bitmask`` int32 [B, ceil(V / 32)] (row r goes with logits row r) and the
    ``rows`` it restricts; any other row is sampled unconstrained."""

    bitmask: torch.Tensor
    rows: list[int]


def allocate_bitmask(batch: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """int32 [batch, ceil(vocab_size / 32)] on CPU, every token allowed. ``pin_memory`` for a mask that
    is copied to the GPU every step."""
    return torch.full((batch, math.ceil(vocab_size / 32)), -1, dtype=torch.int32, pin_memory=pin_memory)


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"logits [B, V] and bitmask [B, W] expected, "
                         f"got {tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if bitmask.shape[1] != math.ceil(logits.shape[1] / 32):
        raise ValueError(f"a bitmask for {logits.shape[1]} logits has {math.ceil(logits.shape[1] / 32)} words per row, "
                         f"got {bitmask.shape[1]}")
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    limit = min(logits.shape[0], bitmask.shape[0])
    if min(rows) < 0 or max(rows) >= limit:
        raise ValueError(f"rows must be in [0, {limit}), got {min(rows)}..{max(rows)}")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """In place: ``logits[r, t] = -inf`` for every row r in ``rows`` and token t not allowed by
    ``bitmask[r]``. logits: [B, V] float32/bfloat16/float16 on CPU or CUDA; bitmask: [>= max(rows)+1,
    ceil(V/32)] int32 on CPU (copied to the logits' device when they are on a GPU) or on that device."""
    rows = list(rows)
    if not rows:
        return
    _check(logits, bitmask, rows)
    xgr = load_xgrammar()
    if logits.device.type == "cpu":
        if bitmask.device.type != "cpu":
            raise ValueError("CPU logits need a CPU bitmask")
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows, backend="cpu")
        return
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=bitmask.is_pinned())
    backend = "triton" if logits.device.type == "cuda" else "torch_native"
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows, backend=backend)


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """The same as ``apply_bitmask`` in plain torch (the slow reference the tests compare against)."""
    rows = list(rows)
    if not rows:
        return
    _check(logits, bitmask, rows)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    words = bitmask.to(logits.device)[index]  # [R, W]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : logits.shape[1]].bool()  # [R, V]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
