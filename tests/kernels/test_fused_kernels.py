"""rms_norm and apply_rotary (Triton; the CPU interpreter without a GPU) against transformers' code;
tests/engine/test_fused_ops_selection.py says which modules ``llm_api.engine.fused_ops`` swaps them into."""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

from kernel_cases import DEVICE, TOLERANCES  # noqa: E402

from llm_api.kernels.rms_norm import rms_norm, rms_norm_reference  # noqa: E402
from llm_api.kernels.rotary import apply_rotary, apply_rotary_reference, rotary_supported  # noqa: E402


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
