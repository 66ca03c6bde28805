"""What a request's life yields to its route: ``TextDelta``s, one ``ChoiceFinished`` per choice, then exactly
one ``Finished``. ``ModelService.generate`` drives a request and ``llm_api.service.output`` makes these from
the engine's outputs; the encoders of ``llm_api.protocols`` turn them into what a client reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llm_api.engine.request import FinishReason
from llm_api.errors import ApiError
from llm_api.text.logprobs import LogprobItem


@dataclass(frozen=True)
class TextDelta:
    text: str  # may be empty when only logprobs are released (the end of a choice)
    index: int = 0  # the choice (0 .. n-1)
    logprobs: tuple[LogprobItem, ...] = ()  # of the tokens this text came from, when asked for
    num_tokens: int = 0  # generated tokens whose text this delta completes (held-back text: a later delta's)


@dataclass(frozen=True)
class ChoiceFinished:
    """One choice ended (sent for n = 1 too, before ``Finished``)."""

    index: int
    reason: FinishReason
    num_generated_tokens: int
    stop_sequence: str | None = None  # the stop string that ended it (reason STOP), None for EOS and the rest


@dataclass(frozen=True)
class Finished:
    """How a request ended: complete (``reason``: choice 0's), or ``error``. Token counts (all choices)
    for usage reports; ``num_cached_tokens``: the prompt tokens the engine found in its prefix cache."""

    reason: FinishReason | None
    error: ApiError | None
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int = 0
    embedding: Any = None  # SamplingParams.pooling: the pooled prompt hidden state (float32 tensor [H], CPU)


Event = TextDelta | ChoiceFinished | Finished
