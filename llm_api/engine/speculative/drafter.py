"""Who drafts, how much, and whether drafting pays (torch-free: the scheduler calls it).

``SpeculativeConfig`` is the engine's setting (``SPECULATIVE_TOKENS`` = k, ``NGRAM_MIN`` / ``NGRAM_MAX``,
``SPECULATIVE_MAX_BATCH``). ``Drafter.draft(request, max_tokens)`` returns the request's draft for this
step (``ngram.propose``, at most ``min(k, max_tokens)`` ids) and ``Drafter.record(request, drafted,
accepted)`` takes the verification's result. The scheduler asks only for sequences that are decoding
(exactly one token without K/V), and only on steps with at most ``max_batch`` such sequences: a bigger
batch is compute-bound already, where verifying k extra positions per sequence costs more than the
accepted tokens save (the default is measured, see docs/benchmarks.md, "Speculative decoding").

Per-sequence switch-off: a sequence whose drafts are mostly rejected pays for k extra positions per
step for nothing. Once it has drafted at least ``min_drafted`` tokens since its last judgement with
fewer than ``min_acceptance`` of them accepted, it stops drafting for ``pause_steps`` steps, then starts
counting afresh (the text may turn to copying later: an answer that quotes its prompt after a preamble).
Each failed judgement in a row doubles the pause, up to ``max_pause_steps``; a passed one resets it.

State lives on the request (``Request.draft_state``): a ``TokenBuffer`` of its ids (appended to, not
rebuilt) and its counts, so nothing is kept for a sequence after it ends. Embeddings prompts
(placeholder ids) never draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_api.engine.request import Request
from llm_api.engine.speculative.ngram import TokenBuffer, propose
from llm_api.model.settings import Settings  # torch-free, like this module


@dataclass(frozen=True)
class SpeculativeConfig:
    # The defaults of SPECULATIVE_TOKENS, NGRAM_MIN, NGRAM_MAX and SPECULATIVE_MAX_BATCH (one declaration each).
    num_tokens: int = Settings.speculative_tokens  # k, draft tokens per step; 0: off
    ngram_min: int = Settings.ngram_min
    ngram_max: int = Settings.ngram_max
    max_batch: int = Settings.speculative_max_batch  # no drafts on a step with more decoding sequences than this
    min_drafted: int = 16  # tokens drafted before the acceptance rate is judged
    min_acceptance: float = 0.2  # below it, the sequence pauses drafting
    pause_steps: int = 8
    max_pause_steps: int = 32

    def __post_init__(self):
        if self.num_tokens < 0:
            raise ValueError(f"speculative num_tokens must be >= 0, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0


@dataclass
class DraftState:
    """One sequence's drafting state."""

    buffer: TokenBuffer = field(default_factory=TokenBuffer)
    drafted: int = 0  # since the last reset
    accepted: int = 0
    paused_for: int = 0  # steps left without drafting
    next_pause: int = 0  # the pause a failed judgement gives (0: config.pause_steps)


@dataclass
class DraftCounters:
    num_drafts: int = 0  # verification steps with a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class Drafter:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.counters = DraftCounters()

    def draft(self, request: Request, max_tokens: int) -> list[int]:
        """Up to ``min(k, max_tokens)`` draft ids for a decoding request ([] when it should not draft)."""
        if max_tokens <= 0 or request.prompt_embeds is not None:
            return []
        state = request.draft_state
        if state is None:
            state = request.draft_state = DraftState(TokenBuffer(request.num_tokens + 64))
        if state.paused_for > 0:
            state.paused_for -= 1
            return []
        state.buffer.sync(request.prompt_token_ids, request.output_token_ids)
        config = self.config
        return propose(state.buffer.view(), min(config.num_tokens, max_tokens), config.ngram_min, config.ngram_max)

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += num_drafted
        counters.num_accepted_tokens += num_accepted
        state = request.draft_state
        if state is None:
            return
        state.drafted += num_drafted
        state.accepted += num_accepted
        config = self.config
        if state.drafted >= config.min_drafted:
            if state.accepted < config.min_acceptance * state.drafted:
                state.paused_for = state.next_pause or config.pause_steps
                state.next_pause = min(2 * state.paused_for, max(config.max_pause_steps, config.pause_steps))
            else:
                state.next_pause = 0
            state.drafted = state.accepted = 0
