"""A shape sweep of the CPU kernels' whole-layer calls against float64 references, on the three builds
(tests/kernels/conftest.py: ``-march=native``, ``x86-64-v3``, ``x86-64``).

* ``paged_decode`` (``test_paged_decode_sweep``): heads of 64, 80 and 128 values; GQA groups of 1, 4 and 8
  (2 key/value heads, 2, 8 or 16 query heads); steps of 1 and 16 rows; a pool of 320 blocks of 16 whose block
  ids are a random permutation, so the tables jump around the pool; contexts of up to 3,000 tokens (188
  blocks); several rows of one sequence at consecutive positions (speculation's drafts, a prompt chunk:
  each attends up to its own position, its own and the earlier rows' stores included), rows stored nowhere
  (slot -1), a row of no context, a context ending on a block boundary, and a sequence sharing another's
  first 20 blocks (a cached prefix). The reference stores first, then attends (``paged_decode``'s contract),
  in float64 from the pool's own values. Every pool row the step must not read holds NaN (the tables'
  padding points at a block of NaN, the rows past each sequence's end and the rows the step stores hold NaN
  beforehand), so a read past a context, through the padding or before the store shows as NaN. The pool
  afterwards is the one before with exactly the stored rows written (bit for bit).
  Tolerance: as tests/kernels/test_cpu_kernels.py's paged test (the softmax and sums in float32, rounded
  once): float32 within 1e-5; bfloat16 within one rounding of the float64 result (the kernel keeps the
  softmax weights in float32, so no looser bound is needed).
* ``decode_layers`` and ``layer_in`` + ``paged_decode`` + ``layer_out`` (``test_decoder_layers_sweep``): a stack
  of two random Llama-shaped layers (hidden 256, MLP 512; heads of 64/80/128 values, GQA 1/4/8; 1 and 16
  rows of the step shapes above over a pool of 24 blocks) against a float64 reference of the layer's math:
  RMSNorm, the q/k/v product, the rotary embedding (transformers' ``rotate_half``), the store then the paged
  attention, o, the residual sum, the post-attention norm, the SiLU-gated MLP, the residual sum, and the
  next norm (handed to the next layer; the last layer's is the model's final norm). Weights:
  ``dense`` (float, with q/k/v and o biases as Qwen2's), ``gguf`` (every format of ``quant.FORMATS``: q Q4_0,
  k Q4_1, v Q5_0, o Q5_1, gate Q8_0, up Q4_K, down Q5_K + Q6_K in two parts, GGUF's layout) and ``rows8``
  (q Q4_1, k Q5_0, v Q6_K, o Q4_K (Q8_0 where the heads' width is not whole blocks of 256) + a dense part,
  gate Q8_0, up Q4_0, down Q5_K + Q4_K; the repackable ones in groups of 8 rows with tails of 4 rows, biases
  on every product). The quantized weights are random blocks (every bit pattern) scaled to ~1/sqrt(K); the
  reference uses the gguf package's de-quantization of the same blocks. The one-call path equals the layer
  by layer one bit for bit, pools included.
  Tolerances, relative to each row's largest value: float32 dense 2e-5 (float32 sums over <= 2,048 terms
  and libm's rsqrt and exp: measured <= 1.3e-6, the scalar build's); quantized 2e-3: a quantized product
  rounds its input to two 8-bit digits a block of 32 (a unit is 1/8001 of the block's largest value, quant.c),
  an error of up to half a unit a value, ~1.5e-4 of the output's scale after K terms of random sign (measured
  per product alone), which the attention and the MLP carry through two layers (measured <= 3e-4); bfloat16
  5e-2: every op rounds to 8 bits (2**-9 relative) as transformers' bfloat16 code does, ~20 such roundings a
  layer (measured <= 1.5e-2). The offset formats' blocks are centred (``CENTRES``): random bytes give every
  block of Q4_1, Q5_1, Q4_K and Q5_K a large common offset, whose sum through o_proj made rows of one large
  common term and cancelling sums, where relative errors say little.
"""

from __future__ import annotations

import ctypes
import math
import zlib
from dataclasses import dataclass
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from llm_api.kernels import cpu
from llm_api.kernels.cpu import library as cpu_library
from llm_api.kernels.cpu import quant
from quant_helpers import random_blocks

pytestmark = pytest.mark.skipif(cpu_library._compiler() is None, reason="no C compiler: the CPU kernels are not built")

BUILDS = ["native", "x86-64-v3", "x86-64"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEAD_DIMS = [64, 80, 128]
GROUPS = [1, 4, 8]  # query heads per key/value head (2 key/value heads)
KV_HEADS = 2


@pytest.fixture(scope="module")
def libraries(kernel_libraries):
    return kernel_libraries


@pytest.fixture(params=BUILDS)
def build(request, libraries, monkeypatch):
    """The kernels of one build in place of the process's (restored after the test)."""
    if request.param not in libraries:
        pytest.skip(f"no {request.param} build here: this CPU does not run its code, or LLM_API_CPU_KERNELS_BUILDS "
                    "leaves it out")
    monkeypatch.setattr(cpu_library, "_library", libraries[request.param])
    return request.param


def _generator(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (NaN compares equal to itself)."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


# ------------------------------------------------------------------------------------------------------
# A step's rows over a paged pool

@dataclass(frozen=True)
class Sequence:
    """A sequence of a step: ``length`` tokens once the step is done, the last ``new`` of them rows of the step
    (each attending up to its own position); ``store``: the rows' K/V are stored (else slot -1, the pool
    already holds them); ``share``: the first blocks of another sequence's table (a cached prefix)."""

    name: str
    length: int
    new: int
    store: bool = True
    share: tuple[str, int] | None = None


# Steps of 16 rows: drafts of a long sequence, decode rows, a prompt chunk ending on a block boundary, rows
# stored nowhere, a first token, a shared prefix, a row of no context; of 1 row: a long decode row.
ATTENTION_STEPS = {
    16: [Sequence("A", 3000, 6), Sequence("G", 1500, 1), Sequence("B", 97, 1), Sequence("C", 64, 3),
         Sequence("D", 33, 2, store=False), Sequence("F", 1, 1), Sequence("E", 340, 1, share=("A", 20)),
         Sequence("Z", 0, 1, store=False)],
    1: [Sequence("A", 2999, 1)],
}
LAYER_STEPS = {
    16: [Sequence("A", 65, 5), Sequence("B", 31, 1), Sequence("C", 6, 6), Sequence("D", 21, 2, store=False),
         Sequence("Z", 0, 1, store=False), Sequence("F", 17, 1)],
    1: [Sequence("A", 41, 1)],
}


@dataclass
class Step:
    slots: torch.Tensor  # [B] int64
    tables: torch.Tensor  # [B, width] int64
    lengths: torch.Tensor  # [B] int64: each row's context
    positions: torch.Tensor  # [B] int64: each row's position (0 for a row of no context)
    written: torch.Tensor  # [blocks x block_size] bool: the pool rows holding context before the step


def _step(sequences: list[Sequence], blocks: int, block_size: int, generator: torch.Generator) -> Step:
    """Tables over a random permutation of the pool's blocks (its last block: NaN padding, ``_pool``)."""
    order = torch.randperm(blocks, generator=generator).tolist()
    poison, free = order[-1], iter(order[:-1])
    tables: dict[str, list[int]] = {}
    rows = []  # (slot, table name, context, position)
    written = torch.zeros(blocks * block_size, dtype=torch.bool)
    for seq in sequences:
        shared = tables[seq.share[0]][:seq.share[1]] if seq.share else []
        table = shared + [next(free) for _ in range(math.ceil(seq.length / block_size) - len(shared))]
        tables[seq.name] = table
        first_new = seq.length - seq.new
        for p in range(seq.length):
            if p < first_new or not seq.store:
                written[table[p // block_size] * block_size + p % block_size] = True
        if seq.length == 0:
            rows.extend([(-1, seq.name, 0, 0)] * seq.new)
        for p in range(max(first_new, 0), seq.length):
            slot = table[p // block_size] * block_size + p % block_size
            rows.append((slot if seq.store else -1, seq.name, p + 1, p))
    width = max(1, max(len(t) for t in tables.values()))
    padded = {name: t + [poison] * (width - len(t)) for name, t in tables.items()}
    return Step(torch.tensor([r[0] for r in rows], dtype=torch.int64),
                torch.tensor([padded[r[1]] for r in rows], dtype=torch.int64),
                torch.tensor([r[2] for r in rows], dtype=torch.int64),
                torch.tensor([r[3] for r in rows], dtype=torch.int64), written)


def _pool(step: Step, blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
          generator: torch.Generator) -> torch.Tensor:
    """[blocks, block_size, Hkv, D]: random values where the step's context is written, NaN everywhere else."""
    pool = torch.randn(blocks * block_size, kv_heads, head_dim, generator=generator)
    pool[~step.written] = float("nan")
    return pool.to(dtype).view(blocks, block_size, kv_heads, head_dim)


def _stored(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``pool`` with ``rows`` [B, Hkv x D] at ``slots`` (< 0: none), as a copy."""
    flat = pool.clone().view(-1, pool.shape[2], pool.shape[3])
    for r, slot in enumerate(slots.tolist()):
        if slot >= 0:
            flat[slot] = rows[r].view(pool.shape[2], pool.shape[3]).to(pool.dtype)
    return flat.view(pool.shape)


def _attend(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, step: Step,
            scaling: float, window: int | None = None) -> torch.Tensor:
    """Each row's attention over its context through its table, in float64: query [B, Hq x D] -> [B, Hq x D],
    the pools [blocks, block_size, Hkv, D] (already holding the step's stores); with a ``window``, over the last
    ``window`` tokens of the context only."""
    _, block_size, kv_heads, head_dim = key_pool.shape
    keys, values = key_pool.reshape(-1, kv_heads, head_dim), value_pool.reshape(-1, kv_heads, head_dim)
    q_heads = query.shape[1] // head_dim
    out = torch.zeros(query.shape[0], q_heads, head_dim, dtype=torch.float64)
    for r in range(query.shape[0]):
        length = int(step.lengths[r])
        if length == 0:
            continue
        p = torch.arange(max(0, length - window) if window else 0, length)
        rows = step.tables[r][p // block_size] * block_size + p % block_size
        k = keys[rows].double().repeat_interleave(q_heads // kv_heads, 1)
        v = values[rows].double().repeat_interleave(q_heads // kv_heads, 1)
        scores = torch.einsum("hd,lhd->hl", query[r].double().view(q_heads, head_dim), k) * scaling
        out[r] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out.view(query.shape[0], -1)


def _assert_one_rounding(got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, rtol32: float = 1e-5):
    """``got`` is ``exact`` (float64) rounded once to ``dtype``, give or take float32 sums (test_cpu_kernels')."""
    assert torch.isfinite(got).all(), "NaN or infinity: a read outside the context, the padding, or before a store"
    error = (got.double() - exact).abs()
    if dtype == torch.float32:
        assert (error <= rtol32 + rtol32 * exact.abs()).all(), error.max()
    else:
        assert (error <= exact.abs() * 2.0 ** -8 + 1e-5).all(), error.max()


# ------------------------------------------------------------------------------------------------------
# paged_decode

ATTENTION_CASES = [(d, g, rows, dt) for d in HEAD_DIMS for g in GROUPS for rows in (1, 16) for dt in DTYPES]


@pytest.mark.parametrize("head_dim,group,rows,dtype", ATTENTION_CASES,
                         ids=[f"d{d}-g{g}-rows{rows}-{dt}" for d, g, rows, dt in ATTENTION_CASES])
def test_paged_decode_sweep(build, head_dim, group, rows, dtype):
    dtype = DTYPES[dtype]
    generator = _generator(f"paged-{head_dim}-{group}-{rows}-{dtype}")
    blocks, block_size, q_heads = 320, 16, KV_HEADS * group
    step = _step(ATTENTION_STEPS[rows], blocks, block_size, generator)
    assert step.slots.shape == (rows,)
    key_cache = _pool(step, blocks, block_size, KV_HEADS, head_dim, dtype, generator)
    value_cache = _pool(step, blocks, block_size, KV_HEADS, head_dim, dtype, generator)
    cpu.check_step_tables(step.slots, step.tables, step.lengths, blocks, block_size)
    # q, k and v as views of one product's rows (row strides wider than each)
    qkv = (torch.randn(rows, (q_heads + 2 * KV_HEADS) * head_dim, generator=generator) * 1.5).to(dtype)
    query, key, value = qkv.split([q_heads * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim], -1)
    expected_keys, expected_values = _stored(key_cache, step.slots, key), _stored(value_cache, step.slots, value)
    scaling = head_dim ** -0.5
    out = cpu.paged_decode(query, key, value, key_cache, value_cache, step.slots, step.tables, step.lengths, scaling)
    assert out.shape == (rows, q_heads * head_dim) and out.dtype == dtype
    assert torch.equal(_bits(key_cache), _bits(expected_keys)) and torch.equal(_bits(value_cache), _bits(expected_values))
    exact = _attend(query, expected_keys, expected_values, step, scaling)
    for r in range(rows):  # (a row at a time: a failure names the row, its context and its slot)
        try:
            _assert_one_rounding(out[r], exact[r], dtype)
        except AssertionError as error:
            raise AssertionError(f"row {r} (context {int(step.lengths[r])}, slot {int(step.slots[r])}): {error}") from None


@pytest.mark.parametrize("window", [1, 37, 4096])
def test_paged_decode_within_a_sliding_window(build, window):
    """Mistral's and Qwen2's windows: each row attends only the last ``window`` tokens of its context (one, a
    window that ends inside a block, one longer than any context); decode rows and a chunk's rows alike."""
    generator = _generator(f"paged-window-{window}")
    blocks, block_size, head_dim, q_heads = 40, 16, 64, 2 * KV_HEADS
    step = _step([Sequence("A", 300, 1), Sequence("B", 90, 4), Sequence("C", 5, 1)], blocks, block_size, generator)
    key_cache = _pool(step, blocks, block_size, KV_HEADS, head_dim, torch.float32, generator)
    value_cache = _pool(step, blocks, block_size, KV_HEADS, head_dim, torch.float32, generator)
    rows = step.slots.shape[0]
    query = torch.randn(rows, q_heads * head_dim, generator=generator)
    key = torch.randn(rows, KV_HEADS * head_dim, generator=generator)
    value = torch.randn(rows, KV_HEADS * head_dim, generator=generator)
    expected_keys, expected_values = _stored(key_cache, step.slots, key), _stored(value_cache, step.slots, value)
    out = cpu.paged_decode(query, key, value, key_cache, value_cache, step.slots, step.tables, step.lengths, 0.125,
                           window)
    _assert_one_rounding(out, _attend(query, expected_keys, expected_values, step, 0.125, window), torch.float32)
    if window < 300:  # (the window changed the answer: the test can fail)
        assert not torch.allclose(out.double(), _attend(query, expected_keys, expected_values, step, 0.125), atol=1e-4)


def test_paged_decode_of_a_group_above_64(build):
    """80 query heads a key/value head: the kernel's per-head maxima and sums leave the stack (kernels.c)."""
    generator = _generator("paged-group-80")
    blocks, block_size, head_dim, q_heads = 40, 16, 16, 80
    step = _step([Sequence("A", 300, 2), Sequence("B", 50, 1)], blocks, block_size, generator)
    key_cache = _pool(step, blocks, block_size, 1, head_dim, torch.float32, generator)
    value_cache = _pool(step, blocks, block_size, 1, head_dim, torch.float32, generator)
    query = torch.randn(3, q_heads * head_dim, generator=generator)
    key, value = torch.randn(3, head_dim, generator=generator), torch.randn(3, head_dim, generator=generator)
    expected_keys, expected_values = _stored(key_cache, step.slots, key), _stored(value_cache, step.slots, value)
    out = cpu.paged_decode(query, key, value, key_cache, value_cache, step.slots, step.tables, step.lengths, 0.25)
    _assert_one_rounding(out, _attend(query, expected_keys, expected_values, step, 0.25), torch.float32)


def test_q_format_knows_every_format(build):
    """``llm_q_format`` (the library's table of block formats) agrees with ``quant.FORMATS`` and refuses others."""
    block, size = ctypes.c_int64(-1), ctypes.c_int64(-1)
    lib = cpu_library.lib()
    for fmt in quant.FORMATS.values():
        assert lib.llm_q_format(fmt.type_id, ctypes.byref(block), ctypes.byref(size)) == 1
        assert (block.value, size.value) == (fmt.block, fmt.bytes), fmt.name
    assert lib.llm_q_format(99, ctypes.byref(block), ctypes.byref(size)) == 0


# ------------------------------------------------------------------------------------------------------
# Decoder layers

HIDDEN, INTER, EPS, THETA = 256, 512, 1e-5, 10000.0
# scale fields (float16) of each format's blocks, by byte offset: d, and m/dmin where there is one
SCALE_OFFSETS = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
                 "Q5_K": (0, 2), "Q6_K": (208,)}
# the formats whose values are offset (Q4_1, Q5_1: d q + m; Q4_K, Q5_K: d sc q - dmin m, sc and m 6-bit sub-block
# scales): m (dmin) as a multiple of d for values of ~0 mean (random bytes give every block a large offset,
# whose common part through the layers made rows of a large common term and cancelling sums)
CENTRES = {"Q4_1": -7.5, "Q5_1": -15.5, "Q4_K": 7.5, "Q5_K": 15.5}
# (q, k, v), o, (gate, up), down: a format per part, None for a dense part; o's and down's rows in two parts
PLANS = {
    "gguf": (("Q4_0", "Q4_1", "Q5_0"), ("Q5_1",), ("Q8_0", "Q4_K"), ("Q5_K", "Q6_K")),
    "rows8": (("Q4_1", "Q5_0", "Q6_K"), ("Q4_K", None), ("Q8_0", "Q4_0"), ("Q5_K", "Q4_K")),
}
SPLIT = (HIDDEN // 2 - 4, HIDDEN // 2 + 4)  # the rows of o's and down's two parts (groups of 8 and a tail)


def _gguf_values(weight: quant.QuantizedWeight) -> torch.Tensor:
    values = gguf.quants.dequantize(weight.blocks.numpy(), GGMLQuantizationType(weight.format.type_id))
    return torch.from_numpy(np.ascontiguousarray(values)).double()


def _quantized(name: str, rows: int, k: int, layout: str, rng: np.random.Generator):
    """Random blocks of ``name`` whose values have a standard deviation of ~1/sqrt(k) (the blocks' float16
    scales multiplied), in ``layout`` where the format has it; and their values (the gguf package's, float64)."""
    fmt = quant.FORMATS[name]
    blocks = random_blocks(fmt, rows, k, rng)
    fields = blocks.numpy().reshape(rows, -1, fmt.bytes)
    if name in CENTRES:  # (the offset m, or dmin, set from d so that the values average ~0, as trained weights do)
        d = fields[:, :, 0:2].copy().view(np.float16).astype(np.float32)
        fields[:, :, 2:4] = (d * CENTRES[name]).astype(np.float16).view(np.uint8)
    factor = k ** -0.5 / float(_gguf_values(quant.QuantizedWeight(fmt, blocks, k)).std())
    for offset in SCALE_OFFSETS[name]:
        half = fields[:, :, offset:offset + 2].copy().view(np.float16)
        fields[:, :, offset:offset + 2] = (half.astype(np.float32) * factor).astype(np.float16).view(np.uint8)
    weight = quant.QuantizedWeight(fmt, blocks, k)
    values = _gguf_values(weight)
    if layout == "rows8" and name in quant.REPACKABLE:
        weight = quant.repack(weight)
    return weight, values


def _product(formats: tuple, sizes: tuple[int, ...], k: int, kind: str, dtype: torch.dtype, generator, rng):
    """A ``quant.Product`` of parts of ``sizes`` rows (formats None: dense) and its weight [sum(sizes), k] (float64)."""
    parts, values = [], []
    for name, rows in zip(formats, sizes):
        if name is None:
            dense = (torch.randn(rows, k, generator=generator) * k ** -0.5).to(dtype)
            parts.append(dense)
            values.append(dense.double())
        else:
            weight, value = _quantized(name, rows, k, kind, rng)
            parts.append(weight)
            values.append(value)
    return quant.Product(parts, k), torch.cat(values)


def _norm(dtype: torch.dtype, generator) -> SimpleNamespace:
    """What ``LayerWeights`` reads of an RMSNorm module."""
    return SimpleNamespace(weight=(1 + 0.1 * torch.randn(HIDDEN, generator=generator)).to(dtype), variance_epsilon=EPS)


def _layer(kind: str, dtype: torch.dtype, head_dim: int, q_heads: int, input_norm, next_norm, generator, rng):
    """One decoder layer's ``LayerWeights`` and its float64 weights for the reference. The dense layers have
    Qwen3's per-head q/k norms too (the quantized ones run without: both paths of ``layer_in``)."""
    n_q, n_kv = q_heads * head_dim, KV_HEADS * head_dim
    post_norm = _norm(dtype, generator)
    if kind == "dense":
        qkv, w_qkv = _product((None,), (n_q + 2 * n_kv,), HIDDEN, kind, dtype, generator, rng)
        o, w_o = _product((None,), (HIDDEN,), n_q, kind, dtype, generator, rng)
        gate_up, w_gate_up = _product((None,), (2 * INTER,), HIDDEN, kind, dtype, generator, rng)
        down, w_down = _product((None,), (HIDDEN,), INTER, kind, dtype, generator, rng)
        with_bias = (True, True, False, False)
    else:
        qkv_formats, o_formats, gate_up_formats, down_formats = PLANS[kind]
        if n_q % 256:  # (o's inputs are the heads' width: K formats need whole blocks of 256)
            o_formats = tuple("Q8_0" if f in ("Q4_K", "Q5_K", "Q6_K") else f for f in o_formats)
        qkv, w_qkv = _product(qkv_formats, (n_q, n_kv, n_kv), HIDDEN, kind, dtype, generator, rng)
        o, w_o = _product(o_formats, SPLIT if len(o_formats) == 2 else (HIDDEN,), n_q, kind, dtype, generator, rng)
        gate_up, w_gate_up = _product(gate_up_formats, (INTER, INTER), HIDDEN, kind, dtype, generator, rng)
        down, w_down = _product(down_formats, SPLIT, INTER, kind, dtype, generator, rng)
        with_bias = (kind == "rows8",) * 4
    biases = [(0.1 * torch.randn(size, generator=generator)).to(dtype) if bias else None
              for bias, size in zip(with_bias, (n_q + 2 * n_kv, HIDDEN, 2 * INTER, HIDDEN))]
    head_norms = [SimpleNamespace(weight=(1 + 0.1 * torch.randn(head_dim, generator=generator)).to(dtype),
                                  variance_epsilon=EPS) for _ in range(2)] if kind == "dense" else [None, None]
    weights = cpu.LayerWeights(input_norm, post_norm, next_norm, qkv, (n_q, n_kv, n_kv), biases[0], head_dim, o, biases[1],
                               gate_up, biases[2], down, biases[3], q_norm=head_norms[0], k_norm=head_norms[1])
    reference = SimpleNamespace(input_norm=input_norm.weight.double(), post_norm=post_norm.weight.double(),
                                next_norm=next_norm.weight.double(), qkv=w_qkv, o=w_o, gate_up=w_gate_up, down=w_down,
                                biases=[None if b is None else b.double() for b in biases],
                                head_norms=[None if n is None else n.weight.double() for n in head_norms])
    return weights, reference


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``q * cos + rotate_half(q) * sin`` of rows [T, H, D] by cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x @ weight.T + (0 if bias is None else bias)


def _reference_layer(w, hidden, cos, sin, key_cache, value_cache, step: Step, head_dim: int, scaling: float):
    """The layer in float64 (the pools: float64 copies, the step's K/V stored into them). Returns (hidden, normed)."""
    rows = hidden.shape[0]
    n_q, n_kv = w.o.shape[1], key_cache.shape[2] * head_dim
    qkv = _linear(_rms_norm(hidden, w.input_norm), w.qkv, w.biases[0])
    q, k = qkv[:, :n_q].view(rows, -1, head_dim), qkv[:, n_q:n_q + n_kv].view(rows, -1, head_dim)
    if w.head_norms[0] is not None:  # (Qwen3's: each head's RMSNorm before the rotary)
        q, k = _rms_norm(q, w.head_norms[0]), _rms_norm(k, w.head_norms[1])
    q = _rotary(q, cos, sin).reshape(rows, n_q)
    k = _rotary(k, cos, sin).reshape(rows, n_kv)
    v = qkv[:, n_q + n_kv:]
    keys, values = _stored(key_cache, step.slots, k), _stored(value_cache, step.slots, v)
    attention = _attend(q, keys, values, step, scaling)
    after_attention = hidden + _linear(attention, w.o, w.biases[1])
    gate_up = _linear(_rms_norm(after_attention, w.post_norm), w.gate_up, w.biases[2])
    out = after_attention + _linear(F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:], w.down, w.biases[3])
    return out, _rms_norm(out, w.next_norm), (k, v)


def _rotary_tables(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's cos/sin [T, head_dim] of each row's position."""
    inverse = 1.0 / THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.double()[:, None] * inverse[None]
    table = torch.cat((angles, angles), dim=-1)
    return table.cos().to(dtype).contiguous(), table.sin().to(dtype).contiguous()


def _assert_rows_close(got: torch.Tensor, exact: torch.Tensor, relative: float, what: str) -> None:
    """Each row within ``relative`` of the row's largest value."""
    assert torch.isfinite(got).all(), f"{what}: NaN or infinity"
    error = (got.double() - exact).abs().amax(-1)
    scale = exact.abs().amax(-1)
    worst = int((error / scale).argmax())
    assert (error <= relative * scale).all(), (f"{what}: row {worst} off by {float(error[worst] / scale[worst]):.2e} of its "
                                               f"largest value (allowed {relative:.0e})")


TOLERANCES = {("dense", torch.float32): 2e-5, ("gguf", torch.float32): 2e-3, ("rows8", torch.float32): 2e-3}
BF16_TOLERANCE = 5e-2
LAYER_CASES = [(d, g, rows, kind, dt) for d in HEAD_DIMS for g in GROUPS for rows in (1, 16)
               for kind in ("dense", "gguf", "rows8") for dt in DTYPES]


@pytest.mark.parametrize("head_dim,group,rows,kind,dtype", LAYER_CASES,
                         ids=[f"d{d}-g{g}-rows{rows}-{kind}-{dt}" for d, g, rows, kind, dt in LAYER_CASES])
def test_decoder_layers_sweep(build, head_dim, group, rows, kind, dtype):
    dtype = DTYPES[dtype]
    name = f"layers-{head_dim}-{group}-{rows}-{kind}-{dtype}"
    generator, rng = _generator(name), np.random.default_rng(zlib.crc32(name.encode()))
    q_heads, blocks, block_size, layers = KV_HEADS * group, 24, 16, 2
    step = _step(LAYER_STEPS[rows], blocks, block_size, generator)
    cpu.check_step_tables(step.slots, step.tables, step.lengths, blocks, block_size)
    norms = [_norm(dtype, generator) for _ in range(layers + 1)]  # each layer's input norm, then the final norm
    stack = [_layer(kind, dtype, head_dim, q_heads, norms[i], norms[i + 1], generator, rng) for i in range(layers)]
    key_caches = [_pool(step, blocks, block_size, KV_HEADS, head_dim, dtype, generator) for _ in range(layers)]
    value_caches = [_pool(step, blocks, block_size, KV_HEADS, head_dim, dtype, generator) for _ in range(layers)]
    hidden = torch.randn(rows, HIDDEN, generator=generator).to(dtype)
    cos, sin = _rotary_tables(step.positions, head_dim, dtype)
    scaling = head_dim ** -0.5
    before = [(k.double(), v.double()) for k, v in zip(key_caches, value_caches)]

    # the whole step in one call, and layer by layer (each over its own copy of the pools)
    one_call_keys, one_call_values = [c.clone() for c in key_caches], [c.clone() for c in value_caches]
    result = cpu.decode_layers(cpu.DecodeStack([w for w, _ in stack], [scaling] * layers), hidden, cos, sin,
                               one_call_keys, one_call_values, step.slots, step.tables, step.lengths)
    assert result is not None
    out, normed_out = result
    by_layer, normed = hidden, None
    for (weights, _), key_cache, value_cache in zip(stack, key_caches, value_caches):
        q, k, v = cpu.layer_in(weights, by_layer, normed, cos, sin)
        attention = cpu.paged_decode(q, k, v, key_cache, value_cache, step.slots, step.tables, step.lengths, scaling)
        by_layer, normed = cpu.layer_out(weights, attention, by_layer)
    assert torch.equal(_bits(out), _bits(by_layer)) and torch.equal(_bits(normed_out), _bits(normed))
    for one_call, alone in zip(one_call_keys + one_call_values, key_caches + value_caches):
        assert torch.equal(_bits(one_call), _bits(alone))

    # against float64
    tolerance = TOLERANCES[kind, dtype] if dtype == torch.float32 else BF16_TOLERANCE
    exact, exact_normed = hidden.double(), None
    for i, ((_, reference), (keys, values)) in enumerate(zip(stack, before)):
        exact, exact_normed, (k, v) = _reference_layer(reference, exact, cos.double(), sin.double(), keys, values, step,
                                                       head_dim, scaling)
        stored = step.slots >= 0
        for pool, rows, what in ((key_caches[i], k, "keys"), (value_caches[i], v, "values")):
            _assert_rows_close(pool.view(-1, KV_HEADS * head_dim)[step.slots[stored]], rows[stored], tolerance,
                               f"layer {i}'s stored {what}")
    _assert_rows_close(out, exact, tolerance, "hidden out")
    _assert_rows_close(normed_out, exact_normed, tolerance, "normed out")

