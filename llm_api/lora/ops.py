"""The LoRA delta of one wrapped linear for a packed batch whose rows use different adapters.

``ModuleSlots`` holds, for one target linear, the weights of the adapter resident in each slot
(1..MAX_LORAS; the adapter's own tensors at its own rank, nothing padded) and its scaling.
``add_delta(x, y, step)`` adds ``(x_g @ A_s.T @ B_s.T) * scaling_s`` to the rows ``g`` of each slot ``s``
of the step, into ``y`` (the base linear's fresh output), in place:

* CPU (and any device without Triton): grouped matmuls, one pair per adapter used this step, over that
  adapter's rows (a slice when they are contiguous, else gathered with ``index_select`` and added back
  with ``index_add_``), in PEFT's order of operations (``lora_B(lora_A(x)) * scaling``), so float32
  answers match PEFT's token for token;
* CUDA with Triton: one kernel over all rows (``llm_api.kernels.lora``, punica's BGMV shape: each token
  reads its slot), on weights stacked per slot and padded to the largest resident rank (built when the
  slots change, not per step).

Rows of slot 0 (the base model) get nothing: the base output is returned as the base module made it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llm_api.kernels import triton_usable
from llm_api.lora.context import LoraStep


class ModuleSlots:
    def __init__(self, max_loras: int):
        self.a: list[torch.Tensor | None] = [None] * (max_loras + 1)  # [slot] -> [r, in]
        self.b: list[torch.Tensor | None] = [None] * (max_loras + 1)  # [slot] -> [out, r]
        self.scaling = [0.0] * (max_loras + 1)
        self._stacked: tuple[torch.Tensor, ...] | None = None  # the kernel's copy (CUDA only)

    def set(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scaling: float) -> None:
        self.a[slot], self.b[slot], self.scaling[slot] = a, b, scaling
        self._stacked = None

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, step: LoraStep) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [T, in]
        y2 = y.view(-1, y.shape[-1])  # [T, out] (a view: the adds land in y)
        if x2.is_cuda and triton_usable(x2.device):
            from llm_api.kernels.lora import lora_bgmv

            stacked = self._stacked_weights(x2.device, x2.dtype)
            if stacked is not None:
                lora_bgmv(y2, x2, step.token_slots, *stacked)
            return y
        for group in step.groups:
            a, b = self.a[group.slot], self.b[group.slot]
            if a is None or b is None:
                continue  # this adapter does not adapt this module
            if group.span is not None:
                start, end = group.span
                y2[start:end] += F.linear(F.linear(x2[start:end], a), b) * self.scaling[group.slot]
            else:
                delta = F.linear(F.linear(x2.index_select(0, group.rows), a), b) * self.scaling[group.slot]
                y2.index_add_(0, group.rows, delta)
        return y

    def _stacked_weights(self, device: torch.device, dtype: torch.dtype):
        """(A [S, R, in], B [S, out, R], ranks [S] int32, scalings [S] float32), slot 0 empty; None when no
        slot adapts this module."""
        if self._stacked is None:
            ranks = [0 if a is None else int(a.shape[0]) for a in self.a]
            if not any(ranks):
                return None
            max_rank = max(ranks)
            some_a = next(a for a in self.a if a is not None)
            some_b = next(b for b in self.b if b is not None)
            num_slots = len(self.a)
            a_stack = torch.zeros(num_slots, max_rank, some_a.shape[1], device=device, dtype=dtype)
            b_stack = torch.zeros(num_slots, some_b.shape[0], max_rank, device=device, dtype=dtype)
            for slot, (a, b) in enumerate(zip(self.a, self.b)):
                if a is not None and b is not None:
                    a_stack[slot, : a.shape[0]] = a
                    b_stack[slot, :, : b.shape[1]] = b
            self._stacked = (a_stack, b_stack, torch.tensor(ranks, dtype=torch.int32, device=device),
                             torch.tensor(self.scaling, dtype=torch.float32, device=device))
        return self._stacked
