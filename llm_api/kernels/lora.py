"""The per-row LoRA delta for a batch whose rows use different adapters: ``lora_bgmv`` (Triton) and its
reference.

``lora_bgmv(y[T, N], x[T, K], token_slots[T], a[S, R, K], b[S, N, R], ranks[S], scalings[S])`` adds, in
place, ``((x[t] @ a[s, :r].T) @ b[s, :, :r].T) * scalings[s]`` to ``y[t]``, with ``s = token_slots[t]`` and
``r = ranks[s]`` (punica's BGMV shape: each token gathers its own adapter's weights). A slot of rank 0
(slot 0: the base model) leaves its row untouched. The rank dimension is padded to the largest resident
rank; entries past a slot's rank are masked, never read. The product ``x @ A.T`` is kept in float32
between the two matmuls. No host synchronization.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_api.kernels.common import device_guard


@triton.jit
def _bgmv_kernel(y_ptr, x_ptr, slots_ptr, a_ptr, b_ptr, ranks_ptr, scalings_ptr, K, N,
                 stride_yt, stride_xt, stride_as, stride_ar, stride_bs, stride_bn,
                 RANK_PAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program per (token, block of output columns): it recomputes the token's x @ A.T (rank <= 64
    # values, cheap against the B block it then reads) so that no second launch or scratch is needed.
    token = tl.program_id(0).to(tl.int64)
    block_n = tl.program_id(1)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    rank = tl.load(ranks_ptr + slot)
    scaling = tl.load(scalings_ptr + slot)
    ranks = tl.arange(0, RANK_PAD)
    shrunk = tl.zeros([RANK_PAD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token * stride_xt + ks, mask=ks < K, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + ranks[:, None] * stride_ar + ks[None, :],
                    mask=(ranks[:, None] < rank) & (ks[None, :] < K), other=0.0).to(tl.float32)
        shrunk += tl.sum(a * x[None, :], axis=1)
    ns = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rank 0 (the base model's rows) masks every column: the row is neither read nor written.
    n_limit = tl.where(rank > 0, N, 0)
    b = tl.load(b_ptr + slot * stride_bs + ns[:, None] * stride_bn + ranks[None, :],
                mask=(ns[:, None] < n_limit) & (ranks[None, :] < rank), other=0.0).to(tl.float32)
    delta = tl.sum(b * shrunk[None, :], axis=1) * scaling
    y = tl.load(y_ptr + token * stride_yt + ns, mask=ns < n_limit, other=0.0)
    tl.store(y_ptr + token * stride_yt + ns, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=ns < n_limit)


def lora_bgmv(y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              ranks: torch.Tensor, scalings: torch.Tensor) -> torch.Tensor:
    num_tokens, k = x.shape
    n = y.shape[1]
    if y.shape[0] != num_tokens or token_slots.shape != (num_tokens,):
        raise ValueError(f"y {tuple(y.shape)}, x {tuple(x.shape)} and token_slots {tuple(token_slots.shape)} "
                         f"disagree on the number of tokens")
    if a.shape[2] != k or b.shape[1] != n or a.shape[1] != b.shape[2] or a.shape[0] != b.shape[0]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} do not fit x [T, {k}] -> y [T, {n}]")
    if x.stride(1) != 1 or y.stride(1) != 1 or a.stride(2) != 1 or b.stride(2) != 1:
        raise ValueError("lora_bgmv needs unit stride along the last dimension of x, y, a and b")
    if num_tokens == 0:
        return y
    block_n = 64
    with device_guard(y):
        _bgmv_kernel[(num_tokens, triton.cdiv(n, block_n))](
            y, x, token_slots, a, b, ranks, scalings, k, n,
            y.stride(0), x.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            RANK_PAD=max(16, triton.next_power_of_2(a.shape[1])), BLOCK_K=64, BLOCK_N=block_n)
    return y


def lora_bgmv_reference(y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                        ranks: torch.Tensor, scalings: torch.Tensor) -> torch.Tensor:
    """The same contract, one token at a time in float32 (the oracle of the kernel tests)."""
    out = y.clone()
    for t, slot in enumerate(token_slots.tolist()):
        r = int(ranks[slot])
        if r == 0:
            continue
        shrunk = a[slot, :r].float() @ x[t].float()  # [r]
        delta = (b[slot, :, :r].float() @ shrunk) * float(scalings[slot])
        out[t] = (y[t].float() + delta).to(y.dtype)
    return out
