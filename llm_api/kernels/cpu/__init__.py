"""The CPU kernel set (issue 37; quantized weights, issue 52): the functions the owned model (``llm_api.models``) calls
on a CPU, C compiled for the host (``library``). A decode step's products of a few rows over both cores, and
RMSNorm, the residual sum + norm, SiLU x up and the rotary embedding each in one pass, with transformers'
rounding; a Llama layer of such a step in two calls around its attention, a step's paged attention in one,
and a step's every layer in one, with LoRA deltas inside (``layers``); products over weights kept in GGUF's
block formats (``quant``); and a greedy step's argmax and finiteness check in one pass (``greedy_pick``).

Why hand-written, and why C through ctypes. A batch-1 decode step on a 2-core CPU is ~60% weight products
and ~25% small per-layer ops (docs/benchmarks.md, "Where a CPU decode step goes"). torch runs a one-row
bfloat16 product at about half the memory's read rate (oneDNN's packed or not), and a one-row float32
product on one core where MKL is not the library's choice (AMD); the small ops are ~60 tensor ops a layer
at 3-20 us each, which a Python rewrite did not shorten. ``torch.compile`` fuses the small ops but took
153 s to compile (issue 37's probe), and its products are torch's. C files of ~1,500 lines compiled with
``-march=native`` in a few seconds do both, and save the Python between the ops: the float products as
register tiles (up to 4 input rows x 4 weight rows, float32 sums in vector registers, AVX512-BF16
``vdpbf16ps`` where the CPU has it, AVX-512 or AVX2 FMA otherwise, scalar C elsewhere; bfloat16 products
of 2-16 rows on AMX tiles where the CPU has AMX, ``use_amx``) over blocks of weight rows split across
OpenMP threads (torch's own OpenMP runtime: the library resolves ``libgomp.so.1`` to the copy torch loaded),
and each elementwise op as one loop. Plain C with raw pointers rather than a torch extension: no torch
headers to compile (tens of seconds per build) and no ABI tied to a torch build.

The contract of each function is its Triton twin's (``llm_api.kernels.rms_norm``, ``.rotary``,
``.activation``, ``.gemv``), for float32 and bfloat16 tensors on the CPU; ``row_product`` takes at most
``max_rows(dtype)`` rows (``takes_product``), and larger inputs stay with ``F.linear``, whose library
products win there. Results: elementwise ops bit-identical to transformers' in float32 except the norm's
sum of squares and the SiLU's ``exp`` (their own order and libm: an ulp or two), products equal up to the
order of float32 sums; bfloat16 rounded once per op as there (tests/kernels/test_cpu_kernels.py).
The C side trusts the pointers and sizes it is handed: the wrappers check shapes before each call, and
the indices a step hands over once a step (``layers.check_step_tables``).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

import llm_api.kernels.cpu.library as library
from llm_api.kernels.cpu.layers import (  # noqa: F401  (the kernel set's whole-layer functions)
    DecodeStack, LayerWeights, LoraProducts, LoraRows, check_step_tables, decode_layers, layer_in, layer_out,
    paged_decode)
from llm_api.kernels.cpu.library import DTYPES, bind, build, load, loaded  # noqa: F401  (the library's entry points)
from llm_api.kernels.cpu.quant import Product, product as quantized_product  # noqa: F401

# The most rows ``row_product`` takes, by dtype: above it the library's products (AMX or MKL tiles) won
# (bench/cpu_kernels.py; docs/benchmarks.md, "CPU kernels").
MAX_ROWS = {torch.float32: 16, torch.bfloat16: 16}
name = "CPU"  # (the kernel set's name in the log)
rotary_stores_kv = False  # (its whole layers store K/V in ``paged_decode``)


def _on_cpu(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return (first.dtype in DTYPES and all(t.device.type == "cpu" and t.dtype == first.dtype for t in tensors))


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# ------------------------------------------------------------------------------------------------------
# The kernel set (llm_api.kernels.kernel_set.WholeLayerKernels; llm_api.kernels.triton_set is the other set)

def takes(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and library.loaded()


def max_rows(dtype: torch.dtype) -> int:
    return MAX_ROWS.get(dtype, 0)


def takes_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """``row_product`` computes ``F.linear(x, weight, bias)`` for these (a few rows, one dtype, plain weight)."""
    rows = x.numel() // max(1, x.shape[-1])
    return (library.loaded() and 0 < rows <= max_rows(x.dtype) and weight.dim() == 2 and weight.is_contiguous()
            and _on_cpu(x, weight, *(() if bias is None else (bias,)))
            and (bias is None or bias.is_contiguous()))


def row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                silu_mul: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; with ``silu_mul``, ``F.linear(silu_and_mul(x), weight, bias)``."""
    if silu_mul:
        x = silu_and_mul(x)
    if not takes_product(x, weight, bias):
        return F.linear(x, weight, bias)
    rows = _rows(x)
    outputs, inputs = weight.shape
    if rows.shape[1] != inputs:
        raise ValueError(f"row_product: x has {rows.shape[1]} features, weight takes {inputs}")
    out = torch.empty((rows.shape[0], outputs), dtype=x.dtype)
    function = library.lib().llm_linear_bf16 if x.dtype == torch.bfloat16 else library.lib().llm_linear_f32
    function(rows.data_ptr(), rows.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
             out.data_ptr(), outputs, rows.shape[0], outputs, inputs, library.threads())
    return out.view(*x.shape[:-1], outputs)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    rows = _rows(x)
    residual_rows = None if residual is None else _rows(residual)
    total = None if residual is None else torch.empty(rows.shape, dtype=x.dtype)
    out = torch.empty(rows.shape, dtype=x.dtype)
    library.lib().llm_rms_norm(rows.data_ptr(), rows.stride(0),
                        None if residual_rows is None else residual_rows.data_ptr(),
                        0 if residual_rows is None else residual_rows.stride(0),
                        None if total is None else total.data_ptr(), 0 if total is None else total.stride(0),
                        weight.data_ptr(), out.data_ptr(), out.stride(0), rows.shape[0], rows.shape[1], eps,
                        DTYPES[x.dtype], library.threads())
    return total, out


def _norm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (library.loaded() and _on_cpu(x, weight) and weight.dim() == 1 and weight.is_contiguous()
            and weight.shape[0] == x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's ``RMSNorm`` of the last dimension: ``weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)``."""
    if not _norm_takes(x, weight):
        y = x.to(torch.float32)
        return weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return _norm(x, None, weight, eps)[1].view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total, rms_norm(total))`` with ``total = residual + x`` rounded to the dtype (one pass)."""
    if x.shape != residual.shape or not _norm_takes(x, weight) or residual.dtype != x.dtype:
        total = residual + x
        return total, rms_norm(total, weight, eps)
    total, out = _norm(x, residual, weight, eps)
    return total.view(x.shape), out.view(x.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]``, the activation rounded to the dtype before the product."""
    if gate_up.shape[-1] % 2 or not library.loaded() or not _on_cpu(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    rows = _rows(gate_up)
    intermediate = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], intermediate), dtype=gate_up.dtype)
    library.lib().llm_silu_and_mul(rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], intermediate,
                            DTYPES[gate_up.dtype], library.threads())
    return out.view(*gate_up.shape[:-1], intermediate)


def rotary_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``apply_rotary`` takes these: q [B, Hq, T, D] and k [B, Hk, T, D] with a contiguous last
    dimension, cos and sin [B or 1, T, D] of one layout, one dtype, on the CPU."""
    if not library.loaded() or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    batch, _, tokens, dim = q.shape
    return (k.shape[0] == batch and k.shape[2] == tokens and k.shape[3] == dim and dim % 2 == 0
            and cos.shape[1:] == (tokens, dim) and cos.shape[0] in (1, batch) and _on_cpu(q, k, cos, sin)
            and q.stride(3) == 1 and k.stride(3) == 1 and cos.stride() == sin.stride() and cos.stride(2) == 1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Llama's ``apply_rotary_pos_emb(q, k, cos, sin)`` (``unsqueeze_dim=1``); outputs keep q's and k's layout."""
    if not rotary_supported(q, k, cos, sin):
        raise ValueError(f"apply_rotary cannot take q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, "
                         f"cos {tuple(cos.shape)} {cos.dtype}")
    cos_strides = (ctypes.c_int64 * 2)(cos.stride(0) if cos.shape[0] == q.shape[0] else 0, cos.stride(1))
    outputs = []
    for x in (q, k):
        out = torch.empty_like(x)
        batch, heads, tokens, dim = x.shape
        if x.numel():
            library.lib().llm_rotary(x.data_ptr(), (ctypes.c_int64 * 3)(*x.stride()[:3]), out.data_ptr(),
                              (ctypes.c_int64 * 3)(*out.stride()[:3]), cos.data_ptr(), sin.data_ptr(), cos_strides,
                              batch, heads, tokens, dim, DTYPES[x.dtype], library.threads())
        outputs.append(out)
    return outputs[0], outputs[1]


def use_amx(on: bool = True) -> bool:
    """Let bfloat16 products of 2-16 rows run on AMX tiles (the default) or not (a benchmark's comparison);
    returns whether they will: the library was built for a CPU with AMX and the kernel permits its tiles."""
    return bool(library.lib().llm_use_amx(int(on)))


def greedy_pick(logits: torch.Tensor) -> torch.Tensor | None:
    """``llm_api.engine.sampler.greedy_pick`` in one pass for logits [B, V] (float32 or bfloat16, last dimension
    contiguous, on the CPU): [each row's argmax, whether all of the row is finite (1 or 0)] (int64 [2, B]);
    None where the library is not loaded or the logits are not such (the caller uses torch)."""
    if (not library.loaded() or logits.dim() != 2 or logits.device.type != "cpu" or logits.dtype not in DTYPES
            or logits.stride(-1) != 1 or logits.shape[1] == 0):
        return None
    out = torch.empty((2, logits.shape[0]), dtype=torch.int64)
    library.lib().llm_greedy_pick(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr(),
                                 DTYPES[logits.dtype], library.threads())
    return out
