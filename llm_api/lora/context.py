"""One engine step's LoRA rows, handed to every wrapped linear of that forward.

The model runner packs a step's tokens into one ``[1, T]`` batch; each token belongs to one request and
so to one adapter slot (0: the base model, no delta). ``LoraStep`` holds that mapping twice: per token
(``token_slots``, a device tensor: what a kernel reads) and grouped by slot (``groups``: what the grouped
matmuls of the CPU path read, with contiguous runs kept as slices). The runner enters ``lora_step(step)``
around the forward (a context variable, like the attention metadata that rides in the model kwargs: the
wrapped linears have no kwargs to carry it); outside it, and for a step without adapter rows, the wrapped
linears add nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch


@dataclass(frozen=True)
class LoraGroup:
    slot: int  # 1..MAX_LORAS
    rows: torch.Tensor  # [n] int64 packed-token indices, on the step's device
    span: tuple[int, int] | None  # (start, end) when the rows are one contiguous run: sliced, not gathered


@dataclass(frozen=True)
class LoraStep:
    token_slots: torch.Tensor  # [T] int32, 0 = no adapter
    groups: tuple[LoraGroup, ...]  # one per slot used this step, slot 0 left out

    @classmethod
    def build(cls, ranges: Sequence[tuple[int, int, int]], num_tokens: int, device: torch.device) -> "LoraStep":
        """``ranges``: (slot, start, end) of each request's tokens in the packed batch."""
        token_slots = torch.zeros(num_tokens, dtype=torch.int32)
        by_slot: dict[int, list[tuple[int, int]]] = {}
        for slot, start, end in ranges:
            if slot:
                token_slots[start:end] = slot
                by_slot.setdefault(slot, []).append((start, end))
        groups = []
        for slot, spans in sorted(by_slot.items()):
            spans.sort()
            contiguous = all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
            rows = torch.cat([torch.arange(s, e) for s, e in spans]).to(device)
            groups.append(LoraGroup(slot, rows, (spans[0][0], spans[-1][1]) if contiguous else None))
        return cls(token_slots.to(device), tuple(groups))


_CURRENT: contextvars.ContextVar[LoraStep | None] = contextvars.ContextVar("llm_api_lora_step", default=None)


@contextlib.contextmanager
def lora_step(step: LoraStep | None) -> Iterator[None]:
    token = _CURRENT.set(step)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_step() -> LoraStep | None:
    return _CURRENT.get()
