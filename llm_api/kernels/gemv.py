"""One input row times a weight matrix (the batch-1 decode step's products), without a second kernel.

At batch 1 every product of a decode step reads a weight matrix once for one row of input. cuBLAS runs
the products whose output is narrow (Llama-3.1-8B's o_proj and down: 4,096 outputs) with split-K, then a
second kernel sums the partial rows: 1.7 us each, 64 a step, 0.11 ms of a 4.66 ms step on an H200; and it
read the small q/k/v and o_proj matrices at 3.1-3.2 TB/s where lm_head reached 4.45 (docs/benchmarks.md,
"Fused decoder layers"). Hand-written because no library call gives a split-K-free batch-1 product, and
because the down projection can compute its input here (below), which a library product cannot.

``row_product(x[1, K], weight[N, K], bias[N] | None) -> [1, N]`` is ``F.linear`` of one row;
``row_product(gate_up[1, 2K], weight[N, K], None, silu_mul=True)`` is ``F.linear(silu_and_mul(gate_up),
weight)``: the activation is computed from gate and up as the product reads its input, so the separate
``kernels.activation`` launch goes too, with its rounding (the activation rounded to the dtype, the
product rounded again, as transformers' Llama MLP).

Grid: one program per ``block_n`` rows of the weight. Each reads its rows whole, ``block_k`` columns at a
time, keeps float32 products in registers ``[block_n, block_k]`` and sums them once at the end, then adds
the bias and rounds to the dtype once. Every program writes its own outputs: nothing to reduce after.

Which configuration runs is a rule by shape (``rule``), read off a sweep of the grid against cuBLAS on an
H200 (bench/gpu_gemv.py, twice, 2026-11-27): the fewest-row, widest-tile programs where the weight has
few rows (o_proj, down: 4,096 rows read in 256 programs of 8 warps), short tiles for an output head, two
rows a program for the rest (q/k/v, gate/up). Each of the 8B's products took 3-19% less time than
cuBLAS's (the figures are in docs/benchmarks.md). Only where that was measured: compute capability 9.0
(H100, H200) and bfloat16 or float16; any other GPU, and float32 (whose greedy GPU tests compare cuBLAS's
order of sums token for token with ``generate()``), keeps the library's way. A first version timed the
candidates at each shape's first call with ``triton.testing.do_bench``; on the H200 its choices changed
from one process to the next (the 8B's q/k/v and o_proj went to cuBLAS in one process, to this kernel in
the next: the host's launch time leaks into such short timings), so the rule replaced it. ``mode``
"triton" (the tests; the CPU interpreter always runs this way) and "library" (a benchmark's before)
override the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llm_api.kernels import interpreter_enabled
from llm_api.kernels.activation import silu_and_mul, silu_mul_rounded
from llm_api.kernels.common import device_guard

FAST_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int


# (rows per program, columns per tile, warps): every configuration ``rule`` picks; the first is the
# interpreter's and "triton" mode's. bench/gpu_gemv.py --quick measures these against cuBLAS.
WIDE_ROWS = GemvConfig(16, 1024, 8)  # o_proj, down: best in both sweeps
HEAD = GemvConfig(16, 256, 4)  # the output head: best in both
DEFAULT = GemvConfig(2, 1024, 4)  # q/k/v best in both; gate/up within 0.2% of the best
CANDIDATES = (HEAD, WIDE_ROWS, DEFAULT, GemvConfig(4, 1024, 4))
HOPPER = (9, 0)

mode = "auto"  # "auto" (``rule``) | "triton" | "library" (see the module docstring)
_chosen: dict[tuple, GemvConfig | None] = {}  # shape key -> what ran (None: the library's), for benchmarks


def rule(outputs: int, inputs: int, capability: tuple[int, int]) -> GemvConfig | None:
    """The configuration for a weight ``[outputs, inputs]`` on a GPU of ``capability``; None: the library's."""
    if capability != HOPPER:
        return None  # (measured nowhere else)
    if outputs >= 16 * inputs:
        return HEAD
    if 4096 <= outputs <= inputs:  # (256 programs or more: fewer rows each would leave SMs idle)
        return WIDE_ROWS
    return DEFAULT


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_w, HAS_BIAS: tl.constexpr,
                 SILU_MUL: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        if EVEN:  # (N and K multiples of the blocks: no masks, the loads vectorize fully)
            if SILU_MUL:
                x = silu_mul_rounded(tl.load(x_ptr + cols), tl.load(x_ptr + K + cols))
            else:
                x = tl.load(x_ptr + cols)
            w = tl.load(w_rows + cols[None, :])
        else:
            col_mask = cols < K
            if SILU_MUL:
                x = silu_mul_rounded(tl.load(x_ptr + cols, mask=col_mask, other=0.0),
                                     tl.load(x_ptr + K + cols, mask=col_mask, other=0.0))
            else:
                x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False) -> bool:
    """``row_product`` can compute this: one contiguous row, a weight with contiguous rows, one dtype and
    device, the input width the weight's (twice it with ``silu_mul``)."""
    width = weight.shape[-1] * (2 if silu_mul else 1) if weight.dim() == 2 else -1
    return (x.dim() >= 1 and x.numel() == width and x.is_contiguous() and weight.stride(-1) == 1
            and x.dtype == weight.dtype and x.device == weight.device
            and (bias is None or (bias.shape == weight.shape[:1] and bias.is_contiguous() and bias.dtype == x.dtype)))


def library_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    silu_mul: bool = False) -> torch.Tensor:
    """What ``row_product`` computes, the library's way (and for whatever it does not take)."""
    return F.linear(silu_and_mul(x) if silu_mul else x, weight, bias)


def row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                silu_mul: bool = False) -> torch.Tensor:
    """``F.linear`` of one row ``x`` (``[..., K]`` holding one row; with ``silu_mul``, gate and up ``[..., 2K]``
    and the activation first): ``[..., N]``, by the configuration chosen for the shape (the module)."""
    if not takes(x, weight, bias, silu_mul):
        return library_product(x, weight, bias, silu_mul)
    config = _config_for(x, weight, bias, silu_mul)
    if config is None:
        return library_product(x, weight, bias, silu_mul)
    return launch(config, x, weight, bias, silu_mul)


def launch(config: GemvConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            silu_mul: bool) -> torch.Tensor:
    n, k = weight.shape
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    even = n % config.block_n == 0 and k % config.block_k == 0
    with device_guard(x):
        _gemv_kernel[(triton.cdiv(n, config.block_n),)](
            x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0), HAS_BIAS=bias is not None,
            SILU_MUL=silu_mul, EVEN=even, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            num_warps=config.num_warps)
    return out


def _config_for(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> GemvConfig | None:
    if mode == "library":
        return None
    if mode == "triton" or interpreter_enabled():
        return CANDIDATES[0]
    if not x.is_cuda:
        return None
    key = (x.device, x.dtype, tuple(weight.shape), bias is not None, silu_mul)
    if key not in _chosen:  # float32 keeps the library's order of sums (recorded as None, as chosen() says)
        capability = torch.cuda.get_device_capability(x.device)
        _chosen[key] = rule(weight.shape[0], weight.shape[1], capability) if x.dtype in FAST_DTYPES else None
    return _chosen[key]


def chosen() -> dict[tuple, GemvConfig | None]:
    """What ran for each one-row shape so far (shape key -> configuration, None: the library's), for benchmarks."""
    return dict(_chosen)
