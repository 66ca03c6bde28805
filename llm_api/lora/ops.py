"""The LoRA delta of one wrapped linear for a packed batch whose rows use different adapters.

``ModuleSlots`` holds, for one target linear, the weights of the adapter resident in each slot
(1..MAX_LORAS; the adapter's own tensors at its own rank) and its scaling. ``add_delta(x, y, step)`` adds
``(x_t @ A_s.T @ B_s.T) * scaling_s`` to each row ``t`` of ``y`` (the base linear's fresh output, in place)
whose token runs under the adapter in slot ``s``; rows of slot 0 (the base model) are left as they are.

* CPU (and any device without Triton): the resident adapters' A are concatenated along the rank into
  ``[C, in]`` and their B into ``[out, C]`` (columns laid out by ``LoraStep.columns``; rebuilt only when
  a slot changes). Per step and module: ``shrunk = where(own_columns, x @ A_cat.T, 0)`` (each row keeps its
  own adapter's columns; the others are *replaced* by zeros, selected, never multiplied by a mask: another
  adapter's product may be infinite, and inf x 0 is NaN, which would reach the row of the base model or of
  another tenant's adapter), ``y += (shrunk @ B_cat.T) * row_scaling``; the expand product meets other
  adapters' B only through those exact zeros (their weights are finite, checked at load, so each such term
  is an exact 0), so a row's numbers are those it gets with the other adapters resident and idle. Two
  matmuls per module whatever the number of adapters in the step, instead of two per adapter and a
  gather / scatter of its rows (measured: the per-adapter loop cost 60% of the decode rate at 4 adapters
  on 2 cores; the extra columns cost a rank-C LoRA, C = the resident ranks summed). The order of
  operations is PEFT's (``lora_B(lora_A(x)) * scaling``), so float32 answers match PEFT's token for token.
* CPU with the CPU kernels (``llm_api.kernels.cpu``, ``FUSED_KERNELS``): where a decoder layer runs whole in
  C, the wrappers are not called; the layer's C calls add the deltas themselves from the same concatenated
  weights (``concatenated_t``: B transposed), each row over only its own adapter's columns, in the same order
  of operations (``llm_api.models.whole_layers``, "LoRA").
* CUDA with Triton: one kernel over all rows (``llm_api.kernels.lora``, punica's BGMV shape: each token
  reads its slot), on weights stacked per slot, padded to the largest resident rank (rebuilt when a slot
  changes).
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
        self._packed: tuple[int, tuple[torch.Tensor, torch.Tensor] | None] | None = None  # (layout version, A/B cat)
        self._stacked: tuple[torch.Tensor, ...] | None = None  # the kernel's copy (CUDA only)
        self._transposed: tuple | None = None  # (the A/B cat it was made from, (A_cat, B_cat.T)): the CPU kernels

    def set(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scaling: float) -> None:
        self.a[slot], self.b[slot], self.scaling[slot] = a, b, scaling
        self._packed = self._stacked = self._transposed = None

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, step: LoraStep) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [T, in]
        y2 = y.view(-1, y.shape[-1])  # [T, out] (a view: the adds land in y)
        if x2.is_cuda and triton_usable(x2.device):
            from llm_api.kernels.lora import lora_bgmv

            stacked = self._stacked_weights(x2.device, x2.dtype)
            if stacked is not None:
                lora_bgmv(y2, x2, step.token_slots, *stacked)
            return y
        packed = self._concatenated(step)
        if packed is None:
            return y  # no resident adapter adapts this module
        a_cat, b_cat = packed
        shrunk = torch.where(step.column_mask, F.linear(x2, a_cat), 0.0)  # [T, C]: selected (module docstring)
        y2 += F.linear(shrunk, b_cat) * step.row_scaling
        return y

    def _concatenated(self, step: LoraStep) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A_cat [C, in], B_cat [out, C]) in the step's column layout; None when no slot adapts this module."""
        if self._packed is not None and self._packed[0] == step.layout_version:
            return self._packed[1]
        some = next(((a, b) for a, b in zip(self.a, self.b) if a is not None and b is not None), None)
        packed = None
        if some is not None:
            total = sum(width for _, width in step.columns)
            a_cat = some[0].new_zeros(total, some[0].shape[1])
            b_cat = some[1].new_zeros(some[1].shape[0], total)
            for slot, (offset, width) in enumerate(step.columns):
                a, b = self.a[slot], self.b[slot]
                if a is not None and b is not None and width:
                    a_cat[offset : offset + a.shape[0]] = a
                    b_cat[:, offset : offset + b.shape[1]] = b
            packed = (a_cat, b_cat)
        self._packed = (step.layout_version, packed)
        return packed

    def concatenated_t(self, step: LoraStep) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``_concatenated`` with B transposed and contiguous, (A_cat [C, in], B_cat.T [C, out]): the CPU
        kernels' delta (``llm_api.kernels.cpu``) adds B's rows along the output, in one pass per column."""
        packed = self._concatenated(step)
        if packed is None:
            return None
        if self._transposed is None or self._transposed[0] is not packed:
            self._transposed = (packed, (packed[0], packed[1].t().contiguous()))
        return self._transposed[1]

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
