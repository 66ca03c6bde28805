"""Blocks of GGUF's formats for the tests: random bytes whose fp16 scales are sane numbers (any other byte of a
block is a valid value), for the formats this project does not quantize to (Q5_1, Q5_K) and for kernel tests
that must see every bit pattern of the values."""

from __future__ import annotations

import numpy as np
import torch

from llm_api.kernels.cpu import quant


def random_blocks(fmt: quant.BlockFormat, rows: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Rows of random blocks whose fp16 scales are sane numbers (every other byte random)."""
    raw = rng.integers(0, 256, size=(rows, fmt.row_bytes(k)), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, fmt.bytes)

    def half(offset: int, low: float, high: float) -> None:
        values = rng.uniform(low, high, size=blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset:offset + 2] = values.view(np.uint8).reshape(*blocks.shape[:2], 2)

    if fmt.name in ("Q4_0", "Q5_0", "Q8_0"):
        half(0, 0.001, 0.05)
    elif fmt.name in ("Q4_1", "Q5_1"):
        half(0, 0.001, 0.05)
        half(2, -0.5, 0.5)
    elif fmt.name in ("Q4_K", "Q5_K"):
        half(0, 0.0005, 0.01)
        half(2, 0.0005, 0.01)
    elif fmt.name == "Q6_K":
        half(208, 0.0005, 0.01)
    return torch.from_numpy(np.ascontiguousarray(raw))
