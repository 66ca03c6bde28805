"""The grammar state of each constrained sequence: its token mask before a step, its advance after.

Contract
- ``GrammarMatcher(compiled)`` follows one sequence; it is not thread-safe (the engine thread owns it).
  Once the grammar is complete the mask allows the stop tokens (and whatever may still extend the match);
  accepting a stop token terminates the matcher. Stop tokens are never allowed before the grammar can end.
- Whoever owns a step (``LLMEngine.step``, speculative verification, the ``generate()`` reference core)
  drives the matchers of its rows, row ``i`` going with ``matchers[i]`` (None: an unconstrained row):
  ``step_mask(matchers, vocab_size)`` before sampling gives the ``TokenMask`` the sampler applies (None
  when no row has a live matcher), and ``advance(matchers, token_ids)`` after sampling feeds each live
  matcher the token its row took. The sampler never touches a matcher, so a caller that samples one
  position at a time (speculative verification) advances exactly the tokens it accepted, and nothing
  needs rolling back.
- A matcher that terminated (its stop token was accepted: only an ``ignore_eos`` row, or a finished row
  of a ``generate()`` batch, is sampled again) leaves its row unconstrained.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from llm_api.structured.bitmask import TokenMask, allocate_bitmask
from llm_api.structured.compiler import CompiledGrammar
from llm_api.structured.library import load_xgrammar

__all__ = ["GrammarMatcher", "fill_bitmasks", "live_rows", "step_mask", "advance"]

logger = logging.getLogger(__name__)


class GrammarMatcher:
    """The grammar state of one sequence. Engine thread only."""

    def __init__(self, grammar: CompiledGrammar):
        self.grammar = grammar
        self._matcher = load_xgrammar().GrammarMatcher(grammar._compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write this sequence's allowed next tokens into ``bitmask[row]`` (a CPU int32 tensor from
        ``allocate_bitmask``). Returns False when every token is allowed (the row needs no masking)."""
        if self._matcher.is_terminated():
            raise RuntimeError("the grammar matcher has terminated (a stop token was accepted): no next token")
        return bool(self._matcher.fill_next_token_bitmask(bitmask, row))

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. False (state unchanged) when the grammar does not allow it or
        the matcher has terminated."""
        if self._matcher.is_terminated():
            return False
        return bool(self._matcher.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete match."""
        return bool(self._matcher.is_terminated())

    def is_completed(self) -> bool:
        """True when the tokens so far form a complete match (a stop token would be allowed now)."""
        return bool(self._matcher.is_completed())


def fill_bitmasks(matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> list[int]:
    """``matchers[i].fill_bitmask(bitmask, rows[i])`` for every i: the one place a step fills its masks.
    Returns the rows that need masking (a row whose matcher allows every token needs none). A plain loop:
    xgrammar's threaded ``BatchGrammarMatcher`` was no faster for 8 rows on 2 cores (see
    bench/grammar_overhead.py); a many-core GPU host may want it here."""
    if len(matchers) != len(rows):
        raise ValueError(f"{len(matchers)} matchers for {len(rows)} rows")
    return [row for matcher, row in zip(matchers, rows) if matcher.fill_bitmask(bitmask, row)]


def live_rows(matchers: Sequence[GrammarMatcher | None]) -> list[int]:
    """Rows whose matcher still constrains them (present, not terminated)."""
    return [row for row, _ in _live(matchers)]


def step_mask(matchers: Sequence[GrammarMatcher | None], vocab_size: int) -> TokenMask | None:
    """The mask of one step: int32 [len(matchers), ceil(vocab_size / 32)], filled for the live rows; its
    ``rows`` are those that need masking at all. None when no row has a live matcher."""
    live = _live(matchers)
    if not live:
        return None
    bitmask = allocate_bitmask(len(matchers), vocab_size)
    return TokenMask(bitmask, fill_bitmasks([m for _, m in live], bitmask, [row for row, _ in live]))


def advance(matchers: Sequence[GrammarMatcher | None], token_ids: Sequence[int]) -> None:
    """Feed each live matcher the token its row took (``token_ids[row]``)."""
    for row, matcher in _live(matchers):
        if not matcher.accept_token(token_ids[row]):
            # Cannot happen with a correct mask (a masked token has probability 0): say so loudly rather
            # than end the whole step; the matcher stays where it was.
            logger.error("grammar matcher refused sampled token %d (row %d)", token_ids[row], row)


def _live(matchers: Sequence[GrammarMatcher | None]) -> list[tuple[int, GrammarMatcher]]:
    return [(row, m) for row, m in enumerate(matchers) if m is not None and not m.is_terminated()]
