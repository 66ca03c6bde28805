"""The batched sampler shared by every generation path.

``Sampler`` turns one step's logits ``[B, V]`` for a batch of sequences, each with its own
``SamplingParams`` (``llm_api.engine.sampling_params``), into token ids ``[B]`` and, for the rows that
ask, their log-probabilities. The paged engine and the ``generate()`` reference both call it, so the two
paths pick tokens the same way.

Per row, in this order (vLLM's order; OpenAI documents none):

1. ``logit_bias``: added to the named tokens' logits;
2. penalties: ``repetition_penalty`` (transformers' rule, over prompt + output tokens), then
   ``frequency_penalty`` x count and ``presence_penalty`` x (count > 0) subtracted, counting the
   sequence's OUTPUT tokens only (OpenAI's definition); the counts live in the row's ``SamplingState``
   and grow by one token per draw, never rebuilt;
3. structured output: the rows of ``SamplerBatch.token_mask`` (a ``TokenMask`` the caller asked its
   grammar matchers for: ``llm_api.structured.matcher.step_mask``) have it applied (disallowed tokens get
   -inf), so temperature, top-k / top-p and logprobs only see allowed tokens. Unconstrained rows of the
   same step are not touched. The sampler applies the mask it is given and never touches a matcher: the
   caller advances them with the tokens it keeps (``llm_api.structured.matcher.advance``), so speculative
   verification, which keeps only the accepted tokens, never has anything to roll back;
4. greedy rows take the argmax; sampling rows are divided by ``temperature``, cut to ``top_k`` and
   ``top_p`` and drawn from with the row's own ``torch.Generator``, so a seeded sequence gives the same
   tokens whatever else shares its batch.

Logprobs (``SamplingParams.logprobs`` = k >= 0): ``log_softmax`` of the distribution the token was drawn
from, i.e. after every transform above: for a sampling row the tempered, top-k/top-p-cut logits (tokens
the cut removed have logprob -inf); for a greedy row the biased and penalized logits at temperature 1
(argmax has no temperature). This is vLLM's ``processed_logprobs`` mode (vLLM v1's default is the raw
model distribution; its v0 took penalties and temperature into account, like here). The k most likely
alternatives come from the same distribution, so a greedy token is always the first of them. It is one
``[R, V]`` log_softmax, one gather and one topk for the R rows that ask, and one copy to the host.

Greedy-only batches without bias, penalties or logprobs cost one argmax and nothing else (bfloat16
logits are converted to float32 first: CPUs without bf16 instructions run a float32 argmax of a wide
row about twice as fast as a bfloat16 one, conversion included).

A request with ``n`` > 1 answers has one ``SamplingState`` per sequence: index 0 uses the request's
``seed``, index i > 0 a seed derived from (seed, i), so the choices differ and each is reproducible.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Sequence

import torch

from llm_api.engine.request import TokenLogprob
from llm_api.engine.sampling_params import SamplingParams
from llm_api.structured.bitmask import TokenMask, apply_bitmask

__all__ = ["Sampler", "SamplerBatch", "SamplerOutput", "SamplingState", "sequence_seed", "prompt_logprobs",
           "greedy_pick"]


def sequence_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed``: ``seed`` itself for index 0 (so
    n = 1 and the first of n choices agree), a 63-bit hash of both otherwise."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class SamplingState:
    """Per-sequence mutable sampler state: the RNG of a sampling sequence, the counts of its output tokens
    (presence/frequency penalties) and its logit bias as tensors (both made on first use, on the logits'
    device)."""

    generator: torch.Generator | None = None
    output_counts: torch.Tensor | None = None  # [V] float32
    bias_ids: torch.Tensor | None = None  # [K] int64
    bias_values: torch.Tensor | None = None  # [K] float32

    @classmethod
    def for_params(cls, params: SamplingParams, device: torch.device | str = "cpu", index: int = 0) -> "SamplingState":
        if params.greedy:
            return cls(None)
        generator = torch.Generator(device=device)
        seed = (sequence_seed(params.seed, index) if params.seed is not None
                else random.SystemRandom().randrange(2**63))
        generator.manual_seed(seed)
        return cls(generator)


@dataclass
class SamplerBatch:
    """One step's rows: parameters, per-sequence state and (for repetition penalty) tokens seen so far."""

    params: Sequence[SamplingParams]
    states: Sequence[SamplingState]
    seen_token_ids: Sequence[Sequence[int] | torch.Tensor | None] = field(default_factory=list)
    # The step's grammar masks (llm_api.structured.matcher.step_mask); None: no row is constrained.
    token_mask: TokenMask | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: list[TokenLogprob | None] | None = None  # per row (None for rows that did not ask); None: no row did


class Sampler:
    """Picks one token per row. Greedy-only batches without bias, penalties or logprobs cost one argmax."""

    def __call__(self, logits: torch.Tensor, batch: SamplerBatch) -> SamplerOutput:
        # logits: [B, V]
        params = batch.params
        if batch.token_mask is None and all(p.argmax_only for p in params):
            return SamplerOutput(_argmax(logits))
        logits, greedy_ids, sampling_rows = self.transform(logits, batch)
        token_ids = greedy_ids if greedy_ids is not None else torch.empty(len(params), dtype=torch.long,
                                                                          device=logits.device)
        if sampling_rows:
            probs = logits[sampling_rows].softmax(dim=-1) if len(sampling_rows) < len(params) else logits.softmax(-1)
            # A row with no allowed token at all (a grammar at a dead end, a bias of -inf on every token) has
            # NaN probabilities, on which multinomial raises and would fail the whole step, every other
            # sequence in it included: such a row takes the argmax, as a greedy row does (its matcher
            # refuses the token when the caller advances it, and logs it), and costs only itself.
            dead_rows = set(torch.isnan(probs[:, 0]).nonzero().flatten().tolist())
            for i, row in enumerate(sampling_rows):
                if i in dead_rows:
                    token_ids[row] = logits[row].argmax()
                else:
                    token_ids[row] = torch.multinomial(probs[i], 1, generator=batch.states[row].generator)[0]
        return self.commit(logits, token_ids, batch)

    # The two halves of a draw, also used one position at a time by speculative verification
    # (llm_api.engine.speculative.verify), so that it sees exactly the distributions drawn from here.

    @staticmethod
    def transform(logits: torch.Tensor, batch: SamplerBatch) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """-> (float32 copy of ``logits`` after bias, penalties, grammar masks and, on sampling rows,
        temperature / top-k / top-p; the argmax of each row before temperature when some row is greedy,
        else None; the sampling rows)."""
        params = batch.params
        logits = logits.to(torch.float32, copy=True)  # transformed in place below
        _apply_logit_bias(logits, batch)
        _apply_penalties(logits, batch)
        if batch.token_mask is not None:
            apply_bitmask(logits, batch.token_mask.bitmask, batch.token_mask.rows)
        sampling_rows = [row for row, p in enumerate(params) if not p.greedy]
        greedy_ids = logits.argmax(dim=-1) if len(sampling_rows) < len(params) else None
        if sampling_rows:
            _temper_and_cut(logits, params, sampling_rows)
        return logits, greedy_ids, sampling_rows

    @staticmethod
    def commit(logits: torch.Tensor, token_ids: torch.Tensor, batch: SamplerBatch) -> SamplerOutput:
        """Feed the picked tokens to the penalty counts; their logprobs from the transformed ``logits``.
        (The grammar matchers are the caller's to advance.)"""
        params = batch.params
        _count_output_tokens(token_ids, batch)
        logprobs = _logprobs(logits, token_ids, params) if any(p.logprobs is not None for p in params) else None
        return SamplerOutput(token_ids, logprobs)


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """[each row's argmax, whether all of the row is finite (1 or 0)] (int64 ``[2, B]``, to read back in one
    copy) for logits ``[B, V]``: on CUDA one pass of ``llm_api.kernels.greedy`` (where torch launches six
    kernels, one of them a one-block argmax); on the CPU one pass of ``llm_api.kernels.cpu`` where its
    library is loaded (where torch takes two: ~3 ms for 16 rows of a 49k vocabulary on a 2-core Xeon); else
    torch."""
    if logits.is_cuda:
        from llm_api.kernels import triton_usable

        if triton_usable(logits.device):
            from llm_api.kernels.greedy import greedy_pick as pick

            return pick(logits.contiguous())
    else:
        from llm_api.kernels import cpu as cpu_kernels

        picked = cpu_kernels.greedy_pick(logits)
        if picked is not None:
            return picked
    return torch.stack((_argmax(logits), torch.isfinite(logits).all(dim=-1).long()))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.dtype == torch.bfloat16 and logits.device.type == "cpu":
        logits = logits.float()  # see the module docstring
    return logits.argmax(dim=-1)


def _rows_tensor(rows: list[int], device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _apply_logit_bias(logits: torch.Tensor, batch: SamplerBatch) -> None:
    for row, p in enumerate(batch.params):
        if not p.logit_bias:
            continue
        state = batch.states[row]
        if state.bias_ids is None:  # once per sequence
            ids, values = zip(*p.logit_bias)
            state.bias_ids = torch.tensor(ids, dtype=torch.long, device=logits.device)
            state.bias_values = torch.tensor(values, dtype=torch.float32, device=logits.device)
        assert state.bias_values is not None  # set with bias_ids
        logits[row].index_add_(0, state.bias_ids, state.bias_values)


def _apply_penalties(logits: torch.Tensor, batch: SamplerBatch) -> None:
    params = batch.params
    for row, p in enumerate(params):
        if p.needs_penalty:
            _apply_repetition_penalty(logits[row], batch.seen_token_ids[row], p.repetition_penalty)
    rows = [row for row, p in enumerate(params) if p.needs_output_counts]
    if not rows:
        return
    row_counts: list[torch.Tensor] = []
    for row in rows:
        state = batch.states[row]
        if state.output_counts is None:
            state.output_counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
        row_counts.append(state.output_counts)
    counts = torch.stack(row_counts)  # [R, V]
    frequency = torch.tensor([params[row].frequency_penalty for row in rows], device=logits.device)[:, None]
    presence = torch.tensor([params[row].presence_penalty for row in rows], device=logits.device)[:, None]
    penalty = counts * frequency + (counts > 0) * presence
    if len(rows) == len(params):
        logits.sub_(penalty)
    else:
        index = _rows_tensor(rows, logits.device)
        logits.index_copy_(0, index, logits.index_select(0, index) - penalty)


def _apply_repetition_penalty(row_logits: torch.Tensor, seen, penalty: float) -> None:
    # Same rule as transformers' RepetitionPenaltyLogitsProcessor: divide positive scores, multiply
    # negative ones, once per distinct token already in the sequence.
    if seen is None or len(seen) == 0:
        return
    ids = seen if torch.is_tensor(seen) else torch.tensor(list(seen), dtype=torch.long)
    ids = ids.to(row_logits.device).unique()
    scores = row_logits[ids]
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    # An extreme (but valid) penalty overflows float32: keep scores finite so softmax stays a distribution.
    limit = torch.finfo(row_logits.dtype).max
    row_logits[ids] = penalized.clamp(-limit, limit)


def _temper_and_cut(logits: torch.Tensor, params: Sequence[SamplingParams], rows: list[int]) -> None:
    """Temperature, top-k and top-p on the sampling ``rows`` of ``logits``, in place (batched per transform)."""
    device = logits.device
    limit = torch.finfo(logits.dtype).max
    temperature = torch.tensor([params[r].temperature for r in rows], dtype=torch.float32, device=device)[:, None]
    if len(rows) == logits.shape[0]:
        logits.div_(temperature).clamp_(max=limit)  # masked -inf entries stay -inf
    else:
        index = _rows_tensor(rows, device)
        logits.index_copy_(0, index, (logits.index_select(0, index) / temperature).clamp(max=limit))
    vocab_size = logits.shape[-1]
    top_k_rows = [r for r in rows if 0 < params[r].top_k < vocab_size]
    if top_k_rows:
        index = _rows_tensor(top_k_rows, device)
        selected = logits.index_select(0, index)  # [K, V]
        ks = torch.tensor([params[r].top_k for r in top_k_rows], device=device)
        kth = torch.topk(selected, int(ks.max())).values.gather(1, (ks - 1)[:, None])  # [K, 1]
        logits.index_copy_(0, index, selected.masked_fill(selected < kth, float("-inf")))
    top_p_rows = [r for r in rows if params[r].top_p < 1.0]
    if top_p_rows:
        index = _rows_tensor(top_p_rows, device)
        selected = logits.index_select(0, index)
        sorted_logits, order = torch.sort(selected, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        top_p = torch.tensor([params[r].top_p for r in top_p_rows], dtype=probs.dtype, device=device)[:, None]
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        drop[:, 0] = False  # a top_p that rounds to 0 in float32 would otherwise drop every token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits.index_copy_(0, index, torch.full_like(selected, float("-inf")).scatter(1, order, sorted_logits))


def _count_output_tokens(token_ids: torch.Tensor, batch: SamplerBatch) -> None:
    for row, p in enumerate(batch.params):
        if p.needs_output_counts:
            counts = batch.states[row].output_counts
            assert counts is not None  # made by _apply_penalties, which runs first on the same batch
            counts.index_add_(0, token_ids[row : row + 1], torch.ones(1, dtype=counts.dtype, device=counts.device))


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """Logits at prompt positions ``[P, V]`` and the prompt token that follows each -> that token's logprob
    and the ``k`` most likely tokens there (the raw distribution: no bias, penalty or temperature)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target_tensor = torch.tensor(targets, dtype=torch.long, device=logits.device)
    values = logprobs.gather(1, target_tensor[:, None])[:, 0].tolist()
    if k <= 0:
        return [TokenLogprob(t, v) for t, v in zip(targets, values)]
    top_values, top_ids = (x.tolist() for x in logprobs.topk(min(k, logits.shape[-1]), dim=-1))
    return [TokenLogprob(t, v, tuple(zip(ids, vals))) for t, v, ids, vals in zip(targets, values, top_ids, top_values)]


def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]) -> list[TokenLogprob | None]:
    rows = [row for row, p in enumerate(params) if p.logprobs is not None]
    if len(rows) == len(params):
        selected, chosen = logits, token_ids
    else:
        index = _rows_tensor(rows, logits.device)
        selected, chosen = logits.index_select(0, index), token_ids.index_select(0, index)
    logprobs = torch.log_softmax(selected, dim=-1)  # [R, V]
    chosen_logprobs = logprobs.gather(1, chosen[:, None])[:, 0]
    num_top = min(max(p.logprobs for p in params if p.logprobs is not None), logits.shape[-1])  # (over the rows that asked)
    if num_top > 0:
        top_value_tensor, top_id_tensor = logprobs.topk(num_top, dim=-1)
        top_values, top_ids = top_value_tensor.tolist(), top_id_tensor.tolist()
    chosen_ids, chosen_values = chosen.tolist(), chosen_logprobs.tolist()
    out: list[TokenLogprob | None] = [None] * len(params)
    for i, row in enumerate(rows):
        k = params[row].logprobs
        top = tuple(zip(top_ids[i][:k], top_values[i][:k])) if k else ()
        out[row] = TokenLogprob(chosen_ids[i], chosen_values[i], top)
    return out
