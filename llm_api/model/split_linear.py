"""Linear layers whose product, for a few rows, is split across the CPU's cores along the output features.

Why: at decode a product has one row per running sequence, and torch's ``F.linear`` (MKL's ``sgemm``) runs a
product of one row on one core: on the 2-core AMD EPYC (flags avx avx2 fma, no avx512; 2 threads, float32,
2026-11-27) the 210 products of a SmolLM2-135M decoder step read 9.4-10.7 GB/s as ``F.linear`` with 1 thread
or 2 alike, while a float32 ``sum`` over the same bytes read 19.3 GB/s with 2 threads. Splitting the weight
``[N, K]`` into ``parts`` row blocks is a free view (``[parts, N / parts, K]``), and one batched product
(``torch.bmm``) over that view gives each core its block: per 210 products, alternating rounds on the same
host, the medians were

    rows            1      8      16     32     128    512
    F.linear (ms)   51.3   81.9   141.2  175.5  374.7  1069.5
    packed (ms)     48.7   85.3   117.6  146.4  324.3  1035.1   (llm_api.model.packed_linear)
    split (ms)      39.1   71.2   99.6   132.0  311.6  1289.5

and batch-1 decode of the embedded model through the engine went from 10.6 tok/s packed (9.8 with
``F.linear``) to 13.4 tok/s split, with the same greedy tokens as ``F.linear`` (``bench/cpu_products.py``).
Above ``MAX_SPLIT_ROWS`` (128: prefill chunks) the layer calls ``F.linear``, whose blocked ``sgemm`` uses every
core itself.

``SplitLinear`` keeps the module's own weight (no copy: a tied ``lm_head`` keeps sharing the embedding's
tensor, where a packed copy costs ``vocab x hidden`` more), so ``state_dict`` and memory are unchanged.
``parts`` is torch's thread count at load (the engine's model thread keeps it: llm_api.service.engine_loop),
lowered to a divisor of the layer's output features; a layer with one part is left as ``nn.Linear``. Only
the 2-core host above was measured; on more cores the same split is expected to scale as the sum does, not
measured.

Which models are split: ``llm_api.model.packed_linear.weight_layout`` (``CPU_PACKED_WEIGHTS``).
"""

from __future__ import annotations

import torch
from torch import nn

from llm_api.model.packed_linear import cpu_linears

MAX_SPLIT_ROWS = 128  # above: F.linear (its blocked sgemm uses every core; split measured 20% slower at 512 rows)


def split_parts(out_features: int, threads: int) -> int:
    """The largest number of row blocks, at most ``threads``, that divides ``out_features`` evenly."""
    return next(p for p in range(max(1, threads), 0, -1) if out_features % p == 0)


class SplitLinear(nn.Module):
    """``y = x @ W^T + b``, any leading shape of ``x``; up to ``MAX_SPLIT_ROWS`` rows as one batched product
    over ``parts`` row blocks of ``W`` (each output is the dot product ``F.linear`` computes for it)."""

    def __init__(self, linear: nn.Linear, parts: int):
        super().__init__()
        if parts < 2 or linear.out_features % parts:
            raise ValueError(f"cannot split {linear.out_features} output features into {parts} parts")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.parts = parts
        self.weight = linear.weight  # the same Parameter (tied weights stay tied)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > MAX_SPLIT_ROWS or rows == 0:
            return nn.functional.linear(x, self.weight, self.bias)
        blocks = self.weight.view(self.parts, self.out_features // self.parts, self.in_features).transpose(1, 2)
        flat = x.reshape(1, rows, self.in_features).expand(self.parts, rows, self.in_features)
        out = torch.bmm(flat, blocks)  # [parts, rows, N / parts]
        out = out.transpose(0, 1).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, parts={self.parts}, "
                f"bias={self.bias is not None}")


def split_linear_weights(model: nn.Module, threads: int | None = None) -> int:
    """Swap every plain ``nn.Linear`` with a CPU weight in ``model`` (``cpu_linears``: none of an offloaded
    model) whose output features split into more than one part for a ``SplitLinear``; return how many.
    ``threads``: default torch's thread count."""
    threads = torch.get_num_threads() if threads is None else threads
    swapped = 0
    for parent, name, child in cpu_linears(model):
        parts = split_parts(child.out_features, threads)
        if parts > 1:
            setattr(parent, name, SplitLinear(child, parts))
            swapped += 1
    return swapped
