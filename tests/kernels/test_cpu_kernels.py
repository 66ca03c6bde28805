"""``llm_api.kernels.cpu``: the C kernels against torch's own ops, built three ways on the host that runs the
tests: ``-march=native`` (what the servers load: AVX512-BF16 on the Intel and Zen 4 kinds), ``x86-64-v3``
(AVX2 + FMA, the AMD kind without AVX-512) and plain ``x86-64`` (the scalar C), so every vector path a host
kind can take is checked on any of them. Float32 elementwise results must be bit-identical where
transformers' ops are (the rotary embedding, the residual sum), products and norms equal up to the order of
float32 sums; bfloat16 within one rounding. The engine and the fused layers around these run in
tests/engine/test_cpu_layers.py."""

from __future__ import annotations

import ctypes
import shutil
import zlib

import pytest
import torch
import torch.nn.functional as F

from llm_api.kernels import cpu
from llm_api.kernels.cpu import library as cpu_library

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the CPU kernels are not built (transformers' code runs)")

BUILDS = ["native", "x86-64-v3", "x86-64"]


@pytest.fixture(scope="module")
def libraries(kernel_libraries):
    """The builds this CPU runs, by march (tests/kernels/conftest.py: built once a session; sanitized where
    ``LLM_API_CPU_KERNELS_SANITIZED=1``, tests/kernels/test_sanitized.py)."""
    return kernel_libraries


@pytest.fixture(params=BUILDS)
def library(request, libraries, monkeypatch):
    """The kernels of one build, in place of the process's (restored after the test)."""
    if request.param not in libraries:
        pytest.skip(f"no {request.param} build here: this CPU does not run its code, or LLM_API_CPU_KERNELS_BUILDS leaves it out")
    monkeypatch.setattr(cpu_library, "_library", libraries[request.param])
    return request.param


def _generator(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def _randn(generator, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=generator) * scale).to(dtype)


def _assert_one_rounding(got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, rtol32: float = 2e-6):
    """``got`` is ``exact`` (computed in float64) rounded once to ``dtype``, give or take the order of sums."""
    exact = exact.double()
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=rtol32, atol=rtol32)
    else:  # one bfloat16 rounding: half a unit in the last place (2**-8 relative), plus the float32 sums
        tolerance = exact.abs() * 2.0 ** -8 + 1e-5
        assert ((got.double() - exact).abs() <= tolerance).all(), (got.double() - exact).abs().max()


# (bfloat16 with AMX, on the native build of an AMX host: 2-16 rows, K a multiple of 32, 32 weight rows at a time
# and the rest by the vector tiles: (3, 64, 576), (2, 40, 64), (16, 96, 576), (7, 1536, 192))
PRODUCT_SHAPES = [(1, 1, 5), (1, 7, 33), (2, 13, 64), (3, 64, 576), (5, 193, 577), (16, 50, 1000), (4, 3, 1536),
                  (2, 40, 64), (16, 96, 576), (7, 1536, 192)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,n,k", PRODUCT_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in PRODUCT_SHAPES])
def test_products(library, dtype, m, n, k):
    generator = _generator(f"{m}-{n}-{k}")
    x, weight, bias = (_randn(generator, m, k, dtype=dtype), _randn(generator, n, k, dtype=dtype, scale=0.1),
                       _randn(generator, n, dtype=dtype))
    assert cpu.takes_product(x, weight, bias) == (m <= cpu.max_rows(dtype))
    for b in (None, bias):
        exact = x.double() @ weight.double().T + (0 if b is None else b.double())
        got = cpu.row_product(x, weight, b)
        assert got.dtype == dtype and got.shape == (m, n)
        # Any order of k float32 sums is within k units of rounding of the sum of magnitudes (the scalar build
        # adds one after another; torch's and the vector builds' blocked sums err less).
        magnitude = x.double().abs() @ weight.double().abs().T + (0 if b is None else b.double().abs())
        summing = (k + 1) * 2.0 ** -24 * magnitude
        rounding = exact.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24)
        assert ((got.double() - exact).abs() <= summing + rounding + 1e-30).all()


def test_amx_tiles_where_the_cpu_has_them(libraries, monkeypatch):
    """On a CPU with AMX the native build multiplies 2-16 bfloat16 rows on its tiles (unless switched off, a
    benchmark's comparison), with the vector tiles' results up to the order of float32 sums; the portable
    builds never do."""
    for march in ("x86-64-v3", "x86-64"):
        if march in libraries:
            monkeypatch.setattr(cpu_library, "_library", libraries[march])
            assert cpu.use_amx(True) is False
    monkeypatch.setattr(cpu_library, "_library", libraries["native"])
    if not cpu.use_amx(True):
        pytest.skip("no AMX on this CPU (or the kernel refuses its tiles): the vector tiles run")
    generator = _generator("amx")
    x, weight, bias = (_randn(generator, 9, 576, dtype=torch.bfloat16), _randn(generator, 100, 576, dtype=torch.bfloat16),
                       _randn(generator, 100, dtype=torch.bfloat16))
    try:
        on = cpu.row_product(x, weight, bias)
        assert cpu.use_amx(False) is False
        off = cpu.row_product(x, weight, bias)
    finally:
        cpu.use_amx(True)
    exact = F.linear(x.double(), weight.double(), bias.double())
    _assert_one_rounding(on, exact, torch.bfloat16)
    _assert_one_rounding(off, exact, torch.bfloat16)


def test_product_of_strided_rows_and_a_leading_shape(library):
    generator = _generator("strided")
    wide = _randn(generator, 3, 100)
    x = wide[:, :40]  # rows 100 apart
    weight = _randn(generator, 24, 40)
    torch.testing.assert_close(cpu.row_product(x, weight), F.linear(x, weight), rtol=2e-6, atol=2e-6)
    x3 = _randn(generator, 1, 2, 40)
    torch.testing.assert_close(cpu.row_product(x3, weight), F.linear(x3, weight), rtol=2e-6, atol=2e-6)


def test_more_rows_than_the_kernel_takes_are_torchs(library):
    generator = _generator("many")
    x, weight = _randn(generator, 40, 64), _randn(generator, 8, 64)
    assert not cpu.takes_product(x, weight)
    torch.testing.assert_close(cpu.row_product(x, weight), F.linear(x, weight), rtol=0, atol=0)


def _rms_norm_reference(x, weight, eps):
    y = x.to(torch.float32)
    return weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norms(library, dtype):
    generator = _generator(str(dtype))
    x, residual = _randn(generator, 5, 576, dtype=dtype), _randn(generator, 5, 576, dtype=dtype)
    weight = _randn(generator, 576, dtype=dtype)
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-5), _rms_norm_reference(x, weight, 1e-5),
                               **({"rtol": 4e-6, "atol": 4e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-5}))
    total, normed = cpu.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, residual + x)  # the residual sum: one rounding, as torch's
    torch.testing.assert_close(normed, _rms_norm_reference(residual + x, weight, 1e-5),
                               **({"rtol": 4e-6, "atol": 4e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-5}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_and_mul(library, dtype):
    generator = _generator(f"silu{dtype}")
    gate_up = _randn(generator, 3, 2 * 1536, dtype=dtype, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu.silu_and_mul(gate_up), F.silu(gate) * up,
                               **({"rtol": 2e-6, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-5}))


def _rotary_reference(q, k, cos, sin):
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_is_transformers_bit_for_bit(library, dtype):
    generator = _generator(f"rotary{dtype}")
    tokens, dim = 7, 64
    # q and k as the attention makes them: [1, T, H, D] projections transposed to [1, H, T, D]
    q = _randn(generator, 1, tokens, 9, dim, dtype=dtype).transpose(1, 2)
    k = _randn(generator, 1, tokens, 3, dim, dtype=dtype).transpose(1, 2)
    angles = torch.rand(1, tokens, dim // 2, generator=generator) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    assert cpu.rotary_supported(q, k, cos, sin)
    got_q, got_k = cpu.apply_rotary(q, k, cos, sin)
    want_q, want_k = _rotary_reference(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.stride() == q.stride()  # (the output keeps the input's layout, as the reference's ops do)


def _attention_reference(query, keys, values, scaling):
    """query [Hq, D], keys/values [L, Hk, D] -> [Hq, D], in float64."""
    group = query.shape[0] // keys.shape[1]
    keys, values = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    scores = torch.einsum("hd,lhd->hl", query.double(), keys) * scaling
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_decode_stores_and_attends(library, dtype):
    generator = _generator(f"paged{dtype}")
    blocks, block_size, kv_heads, q_heads, dim = 12, 4, 3, 9, 64
    key_cache = _randn(generator, blocks, block_size, kv_heads, dim, dtype=dtype)
    value_cache = _randn(generator, blocks, block_size, kv_heads, dim, dtype=dtype)
    # Three sequences: 10 tokens in blocks 7, 2, 9; 1 token in block 4; 5 in blocks 0, 11 (tables padded with 0).
    tables = torch.tensor([[7, 2, 9], [4, 0, 0], [0, 11, 0]], dtype=torch.int64)
    lengths = torch.tensor([10, 1, 5], dtype=torch.int64)
    slots = torch.tensor([9 * block_size + 1, 4 * block_size + 0, -1], dtype=torch.int64)  # (the last: stored nowhere)
    qkv = _randn(generator, 3, (q_heads + 2 * kv_heads) * dim, dtype=dtype)  # q, k, v as views of one product
    query, key, value = qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], -1)
    untouched = key_cache.clone()
    expected_cache = key_cache.clone().view(-1, kv_heads, dim)
    expected_cache[slots[0]] = key[0].view(kv_heads, dim)
    expected_cache[slots[1]] = key[1].view(kv_heads, dim)
    out = cpu.paged_decode(query, key, value, key_cache, value_cache, slots, tables, lengths, dim ** -0.5)
    assert torch.equal(key_cache.view(-1, kv_heads, dim), expected_cache)
    assert torch.equal(value_cache.view(-1, kv_heads, dim)[slots[0]], value[0].view(kv_heads, dim))
    assert torch.equal(key_cache[0], untouched[0]) and torch.equal(key_cache[11], untouched[11])
    for s in range(3):
        rows = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in tables[s].tolist()])[:lengths[s]]
        exact = _attention_reference(query[s].view(q_heads, dim), key_cache.view(-1, kv_heads, dim)[rows],
                                     value_cache.view(-1, kv_heads, dim)[rows], dim ** -0.5)
        _assert_one_rounding(out[s].view(q_heads, dim), exact, dtype, rtol32=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_pick_is_torchs_argmax_and_finiteness(library, dtype):
    """Rows with ties (the first maximum wins, as torch's argmax), a maximum at either end, a NaN, an
    infinity of each sign, and a row taken from a wider tensor (row stride): the argmax of every finite row
    is torch's, and every row's finiteness too."""
    from llm_api.engine import sampler

    generator = _generator(f"greedy{dtype}")
    wide = _randn(generator, 7, 1200, dtype=dtype, scale=4.0)
    logits = wide[:, :1000]
    logits[0, 10] = logits[0, 500] = logits[0].max() + 1  # a tie: index 10
    logits[1, 0] = logits[1].max() + 1
    logits[2, 999] = logits[2].max() + 1
    logits[3, 7] = float("nan")
    logits[4, 70] = float("inf")
    logits[5, 3] = float("-inf")
    picked = cpu.greedy_pick(logits)
    assert picked is not None and picked.dtype == torch.int64 and picked.shape == (2, 7)
    finite = torch.isfinite(logits).all(dim=-1)
    assert picked[1].tolist() == finite.long().tolist() == [1, 1, 1, 0, 0, 0, 1]
    expected = logits.float().argmax(dim=-1)
    assert [picked[0, r].item() for r in range(7) if finite[r]] == [expected[r].item() for r in range(7) if finite[r]]
    assert picked[0, :3].tolist() == [10, 0, 999]
    assert torch.equal(sampler.greedy_pick(logits), picked)  # (the engine's pick takes this path while loaded)
    assert cpu.greedy_pick(logits.t()) is None and cpu.greedy_pick(logits[0]) is None


def test_the_library_is_built_once_per_host_and_reused(tmp_path):
    first = cpu.build(tmp_path)
    modified = first.stat().st_mtime_ns
    assert cpu.build(tmp_path) == first and first.stat().st_mtime_ns == modified
    assert first.parent.parent == tmp_path / "cpu-kernels" and not list(first.parent.glob(".building-*"))


def test_no_compiler_means_no_kernels_and_a_reason(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_library, "_library", None)
    monkeypatch.setattr(cpu_library, "_tried", {})
    monkeypatch.setattr(cpu_library.shutil, "which", lambda name: None)
    assert cpu.load(tmp_path) is False and not cpu.loaded()
    assert "no C compiler" in caplog.text
    assert not cpu.takes(torch.zeros(1))


def test_ctypes_signatures_cover_every_exported_kernel(libraries):
    for library in libraries.values():
        for name in cpu_library.SIGNATURES:
            assert isinstance(getattr(library, name), ctypes._CFuncPtr)
