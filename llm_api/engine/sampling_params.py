"""``SamplingParams``: the validated, per-request description of how to pick tokens (torch-free).

The request formats build it, the scheduler and the request state read it, and the sampler
(``llm_api.engine.sampler``) applies it; this module imports neither torch nor the sampler, so
``llm_api.engine.request`` can name it without an import circle. ``grammar`` is the structured-output
constraint the service compiled (``llm_api.structured.compiler.CompiledGrammar``); the engine gives each
such sequence a matcher. The limits beside it (stop strings, logprobs) are the ones every format checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llm_api.structured.compiler import CompiledGrammar

__all__ = ["SamplingParams", "MAX_STOP_STRINGS", "MIN_SAMPLING_TEMPERATURE", "MAX_STOP_STRING_CHARS",
           "MAX_TOP_LOGPROBS"]

MAX_STOP_STRINGS = 16
MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20  # the most alternatives any format may ask for (OpenAI chat: 0..20)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's, over output tokens
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); ids checked by the request formats
    do_sample: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the k most likely
    n: int = 1  # sequences (choices) generated from the prompt
    # None: none; k >= 0: each prompt token's logprob after the tokens before it (the first has none) and the
    # k most likely there, from the model's raw distribution (the prompt is read, not sampled). The engine
    # then computes the whole prompt (no prefix-cache hits), as vLLM does for prompt logprobs.
    prompt_logprobs: int | None = None
    grammar: "CompiledGrammar | None" = None  # structured output: tokens must follow it (compiled by the service)
    # Embeddings: "mean" | "last": the prompt's last hidden states (the final norm's output) pooled over its
    # tokens, or the last token's. The engine then computes the whole prompt (no prefix-cache hits) and samples
    # one token, which the answer drops (its sequence ends there: max_new_tokens 1).
    pooling: str | None = None

    @property
    def greedy(self) -> bool:
        # A temperature this close to 0 is argmax in all but name, and dividing by it overflows.
        return not self.do_sample or self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def needs_penalty(self) -> bool:
        """Needs the sequence's seen token ids (repetition penalty)."""
        return self.repetition_penalty != 1.0

    @property
    def needs_output_counts(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def argmax_only(self) -> bool:
        """Nothing but the argmax of the raw logits: the sampler's fast path."""
        return (self.greedy and not self.needs_penalty and not self.needs_output_counts and not self.logit_bias
                and self.logprobs is None and self.grammar is None)
