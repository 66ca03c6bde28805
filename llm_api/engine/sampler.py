"""Sampling parameters and the batched sampler shared by every generation path.

``SamplingParams`` is the validated, per-request description of how to pick tokens. ``Sampler`` turns
one step's logits ``[B, V]`` for a batch of requests, each with its own parameters, into token ids
``[B]``: greedy rows take the argmax, sampling rows apply repetition penalty, temperature, top-k and
top-p and draw with the request's own ``torch.Generator`` so a seeded request gives the same tokens
whatever else shares its batch. The paged engine and the ``generate()`` reference both call it, so the
two paths pick tokens the same way.

Structured output: a row whose ``SamplerBatch.grammar_matchers`` entry is a live ``GrammarMatcher`` (its
request's ``SamplingParams.grammar``) is constrained: its token mask is filled and applied after the
repetition penalty and before temperature / top-k / top-p (so sampling only sees allowed tokens), and
the token picked for it is accepted into its matcher here, so every caller keeps the matcher in step
with the tokens it produced. Only constrained rows are masked; unconstrained rows of the same step are
not touched, and a batch without constrained rows costs what it did before. A matcher that terminated
(its stop token was accepted: only an ``ignore_eos`` request or a finished row of a ``generate()``
batch is sampled again) leaves its row unconstrained.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from llm_api.engine.grammar import allocate_bitmask, apply_bitmask

if TYPE_CHECKING:
    from llm_api.engine.grammar import CompiledGrammar, GrammarMatcher

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_STOP_STRING_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    repetition_penalty: float = 1.0
    do_sample: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: "CompiledGrammar | None" = None  # structured output: tokens must follow it (compiled by the service)

    @property
    def greedy(self) -> bool:
        # A temperature this close to 0 is argmax in all but name, and dividing by it overflows.
        return not self.do_sample or self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def needs_penalty(self) -> bool:
        return self.repetition_penalty != 1.0


@dataclass
class SamplingState:
    """Per-request mutable sampler state: the RNG of a sampling request."""

    generator: torch.Generator | None = None

    @classmethod
    def for_params(cls, params: SamplingParams, device: torch.device | str = "cpu") -> "SamplingState":
        if params.greedy:
            return cls(None)
        generator = torch.Generator(device=device)
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        generator.manual_seed(seed)
        return cls(generator)


@dataclass
class SamplerBatch:
    """One step's rows: parameters, RNG state and (for repetition penalty) tokens seen so far."""

    params: Sequence[SamplingParams]
    states: Sequence[SamplingState]
    seen_token_ids: Sequence[Sequence[int] | torch.Tensor | None] = field(default_factory=list)
    # Per row: the GrammarMatcher of a structured-output request, else None; empty: no row is constrained.
    grammar_matchers: Sequence["GrammarMatcher | None"] = field(default_factory=list)


class Sampler:
    """Picks one token per row. Greedy-only batches cost one argmax and nothing else."""

    def __call__(self, logits: torch.Tensor, batch: SamplerBatch) -> torch.Tensor:
        # logits: [B, V] -> token ids: [B] (int64, on logits.device)
        params = batch.params
        matchers = batch.grammar_matchers
        constrained = [row for row, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if not constrained and all(p.greedy and not p.needs_penalty for p in params):
            return logits.argmax(dim=-1)
        # A float32 copy: penalties and masks write into it (and bf16 argmax is slow on CPUs).
        logits = logits.to(torch.float32, copy=True)
        for row, p in enumerate(params):
            if p.needs_penalty:
                _apply_repetition_penalty(logits[row], batch.seen_token_ids[row], p.repetition_penalty)
        if constrained:
            bitmask = allocate_bitmask(len(params), logits.shape[1])
            # fill_bitmask says whether the row needs masking at all (False: every token is allowed).
            masked = [row for row in constrained if matchers[row].fill_bitmask(bitmask, row)]
            apply_bitmask(logits, bitmask, masked)
        token_ids = logits.argmax(dim=-1)
        for row, p in enumerate(params):
            if not p.greedy:
                token_ids[row] = _sample_row(logits[row], p, batch.states[row].generator)
        if constrained:
            picked = token_ids[constrained].tolist()
            for row, token_id in zip(constrained, picked):
                if not matchers[row].accept_token(token_id):
                    # Cannot happen with a correct mask (a masked token has probability 0): say so loudly
                    # rather than end the whole step; the matcher stays where it was.
                    logger.error("grammar matcher refused sampled token %d (row %d)", token_id, row)
        return token_ids


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


def _sample_row(row_logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    limit = torch.finfo(row_logits.dtype).max
    row = (row_logits / p.temperature).clamp(max=limit)  # masked -inf entries stay -inf
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop = (probs.cumsum(dim=-1) - probs) >= p.top_p
        drop[0] = False  # a top_p that rounds to 0 in float32 would otherwise drop every token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        row = torch.full_like(row, float("-inf")).scatter(0, order, sorted_logits)
    probs = row.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[0]
