"""rms_norm, add_rms_norm, silu_and_mul, apply_rotary, rotary_store_kv and the one-row product (Triton; the CPU interpreter without a GPU) against
transformers' code; tests/engine/test_triton_set.py runs the owned decoder on them in the engine."""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

from kernel_cases import DEVICE, TOLERANCES  # noqa: E402

from llm_api.kernels import gemv  # noqa: E402
from llm_api.kernels.greedy import greedy_pick, greedy_pick_reference  # noqa: E402
from llm_api.kernels.activation import silu_and_mul, silu_and_mul_reference  # noqa: E402
from llm_api.kernels.rms_norm import (add_rms_norm, add_rms_norm_reference, rms_norm,  # noqa: E402
                                      rms_norm_reference)
from llm_api.kernels.kv_write import store_kv_reference  # noqa: E402
from llm_api.kernels.rotary import (apply_rotary, apply_rotary_reference, rotary_store_kv,  # noqa: E402
                                    rotary_store_kv_supported, rotary_supported)


def _generator(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


# (id, input shape, input dtype, weight dtype, a strided view of the rows)
NORM_CASES = [
    ("fp32-rows", (3, 5, 96), torch.float32, torch.float32, False),
    ("bf16-one-token", (1, 1, 576), torch.bfloat16, torch.bfloat16, False),
    ("bf16-input-fp32-weight", (2, 4, 64), torch.bfloat16, torch.float32, False),
    ("fp16-strided-rows", (6, 128), torch.float16, torch.float16, True),
    ("empty", (0, 64), torch.float32, torch.float32, False),
]


@pytest.mark.parametrize("case", NORM_CASES, ids=[c[0] for c in NORM_CASES])
def test_rms_norm_matches_llama(case):
    name, shape, dtype, weight_dtype, strided = case
    generator = _generator(name)
    x = (torch.randn(shape, generator=generator) * 3).to(dtype).to(DEVICE)
    if strided:  # every other row of a twice-as-long batch
        x = (torch.randn((2 * shape[0], *shape[1:]), generator=generator) * 3).to(dtype).to(DEVICE)[::2]
    weight = torch.randn(shape[-1], generator=generator).to(weight_dtype).to(DEVICE)
    out = rms_norm(x, weight, 1e-5)
    expected = rms_norm_reference(x, weight, 1e-5)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert not out.isnan().any()
    # (the products are rounded to the input dtype before the weight's: its tolerance applies)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("case", NORM_CASES, ids=[c[0] for c in NORM_CASES])
def test_add_rms_norm_matches_a_residual_sum_then_llama_norm(case):
    name, shape, dtype, weight_dtype, strided = case
    generator = _generator("add-" + name)
    residual = (torch.randn(shape, generator=generator) * 3).to(dtype).to(DEVICE)
    x = (torch.randn((2 * shape[0], *shape[1:]), generator=generator) * 3).to(dtype).to(DEVICE)
    x = x[::2] if strided else x[: shape[0]]
    weight = torch.randn(shape[-1], generator=generator).to(weight_dtype).to(DEVICE)
    total, normed = add_rms_norm(x, residual, weight, 1e-6)
    expected_total, expected_normed = add_rms_norm_reference(x, residual, weight, 1e-6)
    assert total.dtype == expected_total.dtype and normed.dtype == expected_normed.dtype
    if dtype == torch.float32 or DEVICE.type == "cuda":
        assert torch.equal(total, expected_total)  # one rounding of one sum: exact
    else:  # (the CPU interpreter truncates to 16-bit floats instead of rounding: an ulp)
        torch.testing.assert_close(total, expected_total, **TOLERANCES[dtype])
    torch.testing.assert_close(normed, expected_normed, **TOLERANCES[dtype])


def test_add_rms_norm_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="one shape"):
        add_rms_norm(torch.zeros(2, 8, device=DEVICE), torch.zeros(3, 8, device=DEVICE), torch.ones(8, device=DEVICE),
                     1e-6)


# (id, rows shape, intermediate size, dtype, a strided view of the rows)
SILU_CASES = [
    ("fp32-rows", (3, 5), 96, torch.float32, False),
    ("bf16-one-token-two-blocks", (1, 1), 1500, torch.bfloat16, False),
    ("fp16-strided-rows", (4,), 64, torch.float16, True),
    ("empty", (0,), 64, torch.float32, False),
]


@pytest.mark.parametrize("case", SILU_CASES, ids=[c[0] for c in SILU_CASES])
def test_silu_and_mul_matches_llama_mlp(case):
    name, rows, intermediate, dtype, strided = case
    generator = _generator(name)
    gate_up = (torch.randn((*rows, 2 * intermediate), generator=generator) * 4).to(dtype).to(DEVICE)
    if strided:
        gate_up = torch.cat((gate_up, gate_up), dim=0)[::2]
    out = silu_and_mul(gate_up)
    expected = silu_and_mul_reference(gate_up)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_silu_and_mul_refuses_an_odd_width():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 7, device=DEVICE))


# (id, outputs, inputs, dtype, with a bias, SiLU x up first)
GEMV_CASES = [
    ("fp32-even", 256, 1024, torch.float32, False, False),
    ("bf16-ragged-bias", 100, 70, torch.bfloat16, True, False),
    ("fp16-silu-mul", 64, 48, torch.float16, False, True),
    ("bf16-silu-mul-even", 128, 1024, torch.bfloat16, False, True),
]


@pytest.mark.parametrize("config", gemv.CANDIDATES, ids=str)
@pytest.mark.parametrize("case", GEMV_CASES, ids=[c[0] for c in GEMV_CASES])
def test_row_product_matches_linear(case, config):
    """Every configuration the engine may choose, on shapes that fill its blocks and shapes that do not:
    F.linear (after silu_and_mul where fused) computed in float32 on the same inputs, then rounded."""
    name, n, k, dtype, with_bias, silu_mul = case
    generator = _generator(name)
    x = torch.randn(1, k * (2 if silu_mul else 1), generator=generator).to(dtype).to(DEVICE)
    weight = (torch.randn(n, k, generator=generator) / k ** 0.5).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=generator).to(dtype).to(DEVICE) if with_bias else None
    assert gemv.takes(x, weight, bias, silu_mul)
    out = gemv.launch(config, x, weight, bias, silu_mul)
    product_input = silu_and_mul(x) if silu_mul else x
    expected = torch.nn.functional.linear(product_input.float(), weight.float(), None if bias is None else bias.float())
    assert out.shape == (1, n) and out.dtype == dtype
    torch.testing.assert_close(out, expected.to(dtype), **TOLERANCES[dtype])


def test_row_product_leaves_to_the_library_what_it_does_not_take():
    weight = torch.randn(8, 16, device=DEVICE)
    assert not gemv.takes(torch.randn(2, 16, device=DEVICE), weight)  # two rows
    assert not gemv.takes(torch.randn(1, 32, device=DEVICE)[:, ::2], weight)  # strided
    assert not gemv.takes(torch.randn(1, 16, device=DEVICE, dtype=torch.float64), weight)
    assert not gemv.takes(torch.randn(1, 16, device=DEVICE), weight, silu_mul=True)  # needs 2 x 16
    x = torch.randn(3, 16, device=DEVICE)
    torch.testing.assert_close(gemv.row_product(x, weight), torch.nn.functional.linear(x, weight))


def test_row_product_rule_takes_the_measured_configurations_on_hopper_only():
    """The shapes of the H200 sweep (bench/gpu_gemv.py) get the configuration that was best there; a small
    model's narrow weights get two rows a program (enough programs); another GPU gets the library's way."""
    llama_8b = {(6144, 4096): gemv.DEFAULT, (4096, 4096): gemv.WIDE_ROWS, (28672, 4096): gemv.DEFAULT,
                (4096, 14336): gemv.WIDE_ROWS, (128256, 4096): gemv.HEAD}
    for (outputs, inputs), config in llama_8b.items():
        assert gemv.rule(outputs, inputs, (9, 0)) == config
        assert gemv.rule(outputs, inputs, (8, 0)) is None and gemv.rule(outputs, inputs, (10, 0)) is None
    assert gemv.rule(576, 1536, (9, 0)) == gemv.rule(576, 576, (9, 0)) == gemv.DEFAULT
    assert all(config in gemv.CANDIDATES for config in llama_8b.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the rule applies on CUDA")
def test_row_product_follows_the_rule_on_the_gpu(monkeypatch):
    monkeypatch.setattr(gemv, "mode", "auto")
    weight = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    out = gemv.row_product(x, weight)
    expected = gemv.rule(512, 256, torch.cuda.get_device_capability())
    assert gemv.chosen()[(x.device, x.dtype, (512, 256), False, False)] == expected
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), **TOLERANCES[torch.bfloat16])
    # float32 keeps the library's order of sums
    gemv.row_product(x.float(), weight.float())
    assert gemv.chosen()[(x.device, torch.float32, (512, 256), False, False)] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_pick_matches_argmax_and_isfinite(dtype):
    """Rows over several chunks (a vocabulary not a multiple of them), a maximum tied within a chunk and
    across chunks (the lowest index wins, as torch.argmax's), rows with a NaN, +inf, -inf: the tokens of the
    finite rows and every row's finiteness equal torch's."""
    from llm_api.kernels.greedy import BLOCK

    vocab = 2 * BLOCK + 77
    logits = torch.randn(6, vocab, generator=_generator(f"greedy-{dtype}")).to(dtype)
    logits[1, [5, 9, BLOCK + 3]] = 50.0  # ties within the first chunk and across chunks
    logits[2, [2 * BLOCK + 70, BLOCK + 1]] = 40.0  # the later chunk's index is lower
    logits[3, 17] = float("nan")
    logits[4, vocab - 1] = float("inf")
    logits[5, 0] = float("-inf")
    logits = logits.to(DEVICE)
    (token_ids, finite), (expected_ids, expected_finite) = greedy_pick(logits).tolist(), greedy_pick_reference(logits)
    assert finite == expected_finite.tolist() == [1, 1, 1, 0, 0, 0]
    assert token_ids[:3] == expected_ids[:3].tolist() and token_ids[1] == 5 and token_ids[2] == BLOCK + 1
    assert greedy_pick(logits[:0]).shape == (2, 0)


# (id, batch, query heads, key heads, tokens, head dim, dtype)
ROTARY_CASES = [
    ("fp32-gqa", 2, 4, 2, 5, 64, torch.float32),
    ("bf16-decode-token", 3, 8, 2, 1, 128, torch.bfloat16),
    ("fp16-head-dim-96", 1, 3, 3, 7, 96, torch.float16),
]


@pytest.mark.parametrize("case", ROTARY_CASES, ids=[c[0] for c in ROTARY_CASES])
def test_rotary_matches_llama_on_transposed_projections(case):
    name, batch, num_heads, num_kv_heads, tokens, dim, dtype = case
    generator = _generator(name)
    # As the attention hands them over: [B, T, H, D] projections viewed as [B, H, T, D].
    q = torch.randn(batch, tokens, num_heads, dim, generator=generator).to(dtype).to(DEVICE).transpose(1, 2)
    k = torch.randn(batch, tokens, num_kv_heads, dim, generator=generator).to(dtype).to(DEVICE).transpose(1, 2)
    angles = torch.rand(batch, tokens, dim // 2, generator=generator) * 50
    angles = torch.cat((angles, angles), dim=-1)  # (transformers repeats the frequencies over both halves)
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    assert rotary_supported(q, k, cos, sin)
    q_out, k_out = apply_rotary(q, k, cos, sin)
    q_expected, k_expected = apply_rotary_reference(q, k, cos, sin)
    for out, expected in ((q_out, q_expected), (k_out, k_expected)):
        assert out.shape == expected.shape
        # the same memory layout (the stride of a dimension of size 1 is arbitrary)
        assert [st for st, n in zip(out.stride(), out.shape) if n > 1] == \
            [st for st, n in zip(expected.stride(), expected.shape) if n > 1]
        torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_rotary_refuses_what_it_cannot_take():
    q = torch.randn(1, 2, 3, 8, device=DEVICE)
    k = torch.randn(1, 2, 3, 8, device=DEVICE)
    cos = torch.randn(1, 3, 4, device=DEVICE)  # partial rotary: the caller keeps transformers' code
    assert not rotary_supported(q, k, cos, cos)
    with pytest.raises(ValueError, match="cannot take"):
        apply_rotary(q, k, cos, cos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_store_kv_equals_rotary_then_store(dtype):
    """Strided q/k/v views of one product (as the fused layer splits it), a padding slot (-1) that must
    write nothing, NaN-poisoned caches: the rows written and the rotated queries equal apply_rotary followed
    by store_kv; every other row stays NaN."""
    generator = _generator(f"rotary-store-{dtype}")
    tokens, num_heads, num_kv_heads, dim, block_size = 5, 4, 2, 64, 4
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * dim, generator=generator).to(dtype).to(DEVICE)
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([num_heads * dim, num_kv_heads * dim,
                                                           num_kv_heads * dim], -1))
    angles = torch.rand(1, tokens, dim // 2, generator=generator) * 50
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    caches = [torch.full((6, block_size, num_kv_heads, dim), float("nan"), dtype=dtype, device=DEVICE)
              for _ in range(4)]
    key_cache, value_cache, key_expected, value_expected = caches
    slots = torch.tensor([9, 2, -1, 17, 4], device=DEVICE)
    assert rotary_store_kv_supported(q, k, v, cos, sin, key_cache, value_cache)
    q_out = rotary_store_kv(q, k, v, cos, sin, key_cache, value_cache, slots)
    # The reference takes [B, H, T, D]: the packed step as one sequence.
    q_ref, k_ref = apply_rotary_reference(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    store_kv_reference(k_ref[0].transpose(0, 1), v, key_expected, value_expected, slots)
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), **TOLERANCES[dtype])
    torch.testing.assert_close(key_cache, key_expected, equal_nan=True, **TOLERANCES[dtype])
    assert torch.equal(value_cache.isnan(), value_expected.isnan())
    torch.testing.assert_close(value_cache, value_expected, equal_nan=True, atol=0, rtol=0)
    # A cache of another dtype, or a batch of two rows: the caller keeps the separate kernels.
    assert not rotary_store_kv_supported(q, k, v, cos, sin, key_cache.float() if dtype != torch.float32
                                         else key_cache.double(), value_cache)
    assert not rotary_store_kv_supported(q, k, v, cos.expand(2, -1, -1), sin.expand(2, -1, -1), key_cache,
                                         value_cache)
