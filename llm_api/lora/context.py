"""One engine step's LoRA rows, handed to every wrapped linear of that forward.

The model runner packs a step's tokens into one ``[1, T]`` batch; each token belongs to one request and
so to one adapter slot (0: the base model, no delta). ``LoraStep`` holds that mapping in the two forms the
delta op reads (``llm_api.lora.ops``):

* ``token_slots`` ``[T]``: each token's slot (the Triton kernel gathers its adapter's weights by it);
* ``column_mask`` ``[T, C]`` (bool) and ``row_scaling`` ``[T, 1]``: the CPU path concatenates the resident
  adapters' ranks into ``C`` columns (slot ``s`` owns ``columns[s] = (offset, width)``, the same in every
  module), so one shrink matmul gives every token every adapter's ``x @ A.T``; the mask selects only the
  token's own adapter's columns (the rest are replaced by zeros), the expand matmul then adds only that
  adapter's ``B``, and ``row_scaling`` is that adapter's scaling (0 for the base model's rows).

``layout_version`` names the column layout (it changes when a slot is refilled), so a module rebuilds its
concatenated weights only then. The runner enters ``lora_step(step)`` around the forward (a context
variable, as the attention metadata rides in the model kwargs: the wrapped linears get no kwargs); outside
it, and for a step without adapter rows, the wrapped linears add nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch


@dataclass(frozen=True)
class LoraStep:
    token_slots: torch.Tensor  # [T] int32, 0 = no adapter
    column_mask: torch.Tensor  # [T, C] bool, True on the columns of the token's adapter
    row_scaling: torch.Tensor  # [T, 1] model dtype, the token's adapter's scaling (0: none)
    columns: tuple[tuple[int, int], ...]  # [slot] -> (offset, width) of its columns (slot 0: (0, 0))
    layout_version: int

    @classmethod
    def build(cls, ranges: Sequence[tuple[int, int, int]], num_tokens: int, device: torch.device, dtype: torch.dtype,
              columns: Sequence[tuple[int, int]], scalings: Sequence[float], layout_version: int) -> "LoraStep":
        """``ranges``: (slot, start, end) of each request's tokens in the packed batch."""
        total = sum(width for _, width in columns)
        token_slots = torch.zeros(num_tokens, dtype=torch.int32)
        mask = torch.zeros(num_tokens, total, dtype=torch.bool)
        row_scaling = torch.zeros(num_tokens, 1)
        for slot, start, end in ranges:
            if slot:
                offset, width = columns[slot]
                token_slots[start:end] = slot
                mask[start:end, offset : offset + width] = True
                row_scaling[start:end] = scalings[slot]
        return cls(token_slots.to(device), mask.to(device), row_scaling.to(device, dtype), tuple(columns),
                   layout_version)


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
