"""lora_bgmv (Triton; the CPU interpreter without a GPU) against its torch reference and against the masked
shrink/expand matmuls of the CPU path (llm_api.lora.ops), on a packed batch mixing base rows and several adapters of
different ranks, rows of one adapter scattered through the batch."""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

from kernel_cases import DEVICE, TOLERANCES  # noqa: E402

from llm_api.kernels.lora import lora_bgmv, lora_bgmv_reference  # noqa: E402
from llm_api.lora.context import LoraStep  # noqa: E402
from llm_api.lora.ops import ModuleSlots  # noqa: E402

# (id, tokens, in, out, ranks of slots 1.., slot of each request's run of tokens, dtype)
CASES = [
    ("fp32-two-adapters", 13, 96, 80, [8, 4], [(0, 3), (1, 4), (2, 2), (1, 2), (0, 2)], torch.float32),
    ("bf16-rank64-odd-sizes", 9, 130, 70, [64, 1, 16], [(3, 1), (1, 3), (0, 1), (2, 4)], torch.bfloat16),
    ("all-base", 5, 64, 64, [8], [(0, 5)], torch.float32),
]


def _case(case):
    name, num_tokens, k, n, ranks, runs, dtype = case
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = torch.randn(num_tokens, k, generator=generator).to(DEVICE, dtype)
    y = torch.randn(num_tokens, n, generator=generator).to(DEVICE, dtype)
    slots = ModuleSlots(len(ranks))
    for slot, r in enumerate(ranks, start=1):
        a = (torch.randn(r, k, generator=generator) / k**0.5).to(DEVICE, dtype)
        b = torch.randn(n, r, generator=generator).to(DEVICE, dtype)
        slots.set(slot, a, b, 2.0 / r)
    ranges, start = [], 0
    for slot, count in runs:
        ranges.append((slot, start, start + count))
        start += count
    assert start == num_tokens
    columns, offset = [(0, 0)], 0
    for r in ranks:
        columns.append((offset, r))
        offset += r
    step = LoraStep.build(ranges, num_tokens, DEVICE, dtype, columns, slots.scaling, layout_version=1)
    return x, y, slots, step, dtype


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_reference_and_grouped_path(case):
    x, y, slots, step, dtype = _case(case)
    a, b, ranks, scalings = slots._stacked_weights(x.device, dtype) or (None,) * 4
    if a is None:  # no slot adapts: nothing to launch, the base rows stay as they are
        return
    expected = lora_bgmv_reference(y, x, step.token_slots, a, b, ranks, scalings)
    got = lora_bgmv(y.clone(), x, step.token_slots, a, b, ranks, scalings)
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])
    base_rows = step.token_slots == 0
    assert torch.equal(got[base_rows], y[base_rows])  # slot 0: untouched, bit for bit
    # The CPU path (one shrink and one expand matmul over the masked, concatenated ranks) gives the same
    # deltas, and leaves the base rows bit for bit too.
    dense = y.clone().cpu()
    for slot in range(1, len(slots.a)):
        slots.set(slot, slots.a[slot].cpu(), slots.b[slot].cpu(), slots.scaling[slot])
    step_cpu = LoraStep(step.token_slots.cpu(), step.column_mask.cpu(), step.row_scaling.cpu(), step.columns, 1)
    slots.add_delta(x.cpu(), dense, step_cpu)
    torch.testing.assert_close(dense.to(got.device), expected, **TOLERANCES[dtype])
    assert torch.equal(dense[base_rows.cpu()], y.cpu()[base_rows.cpu()])


def test_bad_shapes_are_refused():
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="do not fit"):
        lora_bgmv(torch.zeros(4, 6), x, torch.zeros(4, dtype=torch.int32), torch.zeros(2, 4, 9), torch.zeros(2, 6, 4),
                  torch.zeros(2, dtype=torch.int32), torch.zeros(2))
