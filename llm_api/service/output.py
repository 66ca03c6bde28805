"""Output processing: one request's engine outputs become its events (vLLM's output processor, per request).

``RequestState.process(out)`` takes one ``RequestOutput`` of the engine and returns the events it releases
(``llm_api.service.events``), in order; once it has decided how the request ends it sets ``end`` (then the
driver, ``ModelService.generate``, stops reading the engine). Per choice (``params.n``) it keeps a
detokenizer with the request's stop strings and the native marker (``TextStream``), the logprobs of
tokens whose text is held back, and token counts. What it decides:

* a choice ends at its engine finish (EOS, length) or at a stop string; the request ends once every choice
  has, with choice 0's reason. A choice that meets a stop string while others run is aborted alone in the
  engine (``abort_choice``); its later outputs are dropped;
* an abort (a cancel) ends the request with 499 ``cancelled``; a non-finite output with 500
  ``non_finite_output`` (naming the LoRA adapter as the likely cause when there is one); an answer whose
  grammar spelled out the native end-of-stream marker with 422 ``marker_in_answer``;
* logprobs: every generated token up to and including the one that completed a stop string, but not the
  end-of-sequence token that ended a choice (echo keeps it: evaluation harnesses count on one entry per
  prompt and sampled token); an output of several tokens (speculative decoding) is pushed token by token,
  so a stop string ends the answer, its usage and its logprobs where it would one token at a time;
* echo: the prompt is each choice's first text, with its tokens' logprobs when the prompt's were asked for;
  with ``echo_only`` (max_tokens 0) the token sampled after the prompt is not part of the answer.

What it leaves to the driver: the deadline, the engine's errors, the metrics clock (``num_generated_tokens``
grows by what each output adds to the answer), and the live table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from llm_api.engine.request import FinishReason, RequestOutput
from llm_api.engine.sampling_params import SamplingParams
from llm_api.errors import ApiError
from llm_api.service.events import ChoiceFinished, Event, Finished, TextDelta
from llm_api.text.detokenizer import StreamDelta, TextStream
from llm_api.text.logprobs import LogprobItem, TokenTexts


@dataclass(frozen=True)
class Echo:
    """What a request with ``echo`` repeats: its prompt (``text``: as sent, None for ids or a chat, then
    decoded), and whether the answer is the prompt alone (max_tokens 0)."""

    text: str | None
    only: bool


class RequestState:
    """One request's output state (module docstring)."""

    def __init__(self, tokenizer, params: SamplingParams, marker: str, num_prompt_tokens: int,
                 prompt_ids: list[int] | None, echo: Echo | None, token_texts: Callable[[], TokenTexts],
                 abort_choice: Callable[[int], None], adapter: str | None = None):
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.num_generated_tokens = 0
        self.num_cached_tokens = 0  # of the prompt, found in the prefix cache (the engine's outputs say)
        self.embedding = None  # params.pooling: the pooled prompt hidden state (the engine's first output has it)
        self.end: Finished | None = None
        self._tokenizer = tokenizer
        self._choices = [_Choice(TextStream(tokenizer, params.stop, marker)) for _ in range(params.n)]
        self._token_texts = token_texts  # (built on first use: only requests with logprobs need it)
        self._prompt_ids = prompt_ids
        self._echo = echo
        self._echoed: set[int] = set()  # choices whose answer began with the prompt
        self._abort_choice = abort_choice
        self._adapter = adapter

    def process(self, out: RequestOutput) -> list[Event]:
        choice = self._choices[out.index]
        if choice.reason is not None or self.end is not None:
            return []  # a choice that met a stop string: the rest of its tokens are not the answer
        if out.finished and out.finish_reason is FinishReason.ABORT:
            self.end = self.failed(ApiError(499, "cancelled", "the request was cancelled"))
            return []
        if out.finished and out.finish_reason is FinishReason.NON_FINITE:
            self.end = self.failed(ApiError(
                500, "non_finite_output", "the model's output for this request was not finite (NaN or infinity); "
                "with a LoRA adapter, its weights are the likely cause" if self._adapter else
                "the model's output for this request was not finite (NaN or infinity)"))
            return []
        events: list[Event] = []
        if out.embedding is not None:
            self.embedding = out.embedding
        if self._echo is not None and out.index not in self._echoed:
            self._echoed.add(out.index)
            events.append(self._echo_delta(out))
        if self._echo is not None and self._echo.only:
            choice.reason = FinishReason.LENGTH
            events.append(ChoiceFinished(out.index, choice.reason, 0))
            if all(c.reason is not None for c in self._choices):
                self.end = self._finished(FinishReason.LENGTH)
            return events
        delta, num_used = _push_tokens(choice.text, out.new_token_ids)
        if choice.text.marker_removed and self.params.grammar is not None:
            # (never silently: without the marker text the answer would no longer follow its grammar)
            self.end = self.failed(ApiError(422, "marker_in_answer", "the answer this request's grammar allows "
                                            "spelled out the end-of-stream marker, which this route reserves for "
                                            "the end of a stream; use an OpenAI route, or a grammar that cannot "
                                            "produce the marker's text"))
            return events
        choice.num_tokens += num_used
        choice.num_unreleased_tokens += num_used
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        self.num_generated_tokens += num_used
        if self.params.logprobs is not None and out.logprobs:
            # The end-of-sequence token that ended the choice is not part of the answer (echo keeps it).
            kept = (out.logprobs[:num_used] if num_used < len(out.new_token_ids)
                    else out.logprobs[:-1] if out.finish_reason is FinishReason.STOP and self._echo is None
                    else out.logprobs)
            token_texts = self._token_texts()
            choice.logprobs.extend(token_texts.item(lp) for lp in kept)
        if delta.text:
            events.append(choice.delta(delta.text, out.index))
        if delta.stopped or out.finished:
            if not delta.stopped:
                tail = choice.text.finish()
                if tail or choice.logprobs:
                    events.append(choice.delta(tail, out.index))
            elif choice.logprobs:
                events.append(choice.delta("", out.index))
            reason = FinishReason.STOP if delta.stopped else out.finish_reason
            assert reason is not None  # a finished output carries its reason
            choice.reason = reason
            if delta.stopped and not out.finished and len(self._choices) > 1:
                self._abort_choice(out.index)  # the other choices go on
            events.append(ChoiceFinished(out.index, choice.reason, choice.num_tokens,
                                         choice.text.matched_stop if delta.stopped else None))
            if all(c.reason is not None for c in self._choices):
                first_reason = self._choices[0].reason
                assert first_reason is not None  # (every choice has one)
                self.end = self._finished(first_reason)
        return events

    def failed(self, error: ApiError) -> Finished:
        return Finished(None, error, self.num_prompt_tokens, self.num_generated_tokens, self.num_cached_tokens)

    def _finished(self, reason: FinishReason) -> Finished:
        return Finished(reason, None, self.num_prompt_tokens, self.num_generated_tokens, self.num_cached_tokens,
                        self.embedding)

    def _echo_delta(self, out: RequestOutput) -> TextDelta:
        """The prompt, as the first text of choice ``out.index`` (echo), with its tokens' logprobs when asked
        for: the first token has none (nothing before it scores it), the others come with the first output."""
        assert self._echo is not None  # (only called for an echo)
        prompt_ids = self._prompt_ids or []
        text = self._echo.text if self._echo.text is not None else self._tokenizer.decode(prompt_ids)
        if self.params.prompt_logprobs is None or not prompt_ids:
            return TextDelta(text, out.index, ())
        token_texts = self._token_texts()
        items = [LogprobItem(token_texts(prompt_ids[0]), None)]
        items += [token_texts.item(lp) for lp in out.prompt_logprobs or ()]
        return TextDelta(text, out.index, tuple(items))


@dataclass
class _Choice:
    """One choice's progress."""

    text: TextStream
    logprobs: list[LogprobItem] = field(default_factory=list)  # not yet sent with a delta
    num_tokens: int = 0
    num_unreleased_tokens: int = 0  # counted in num_tokens, not yet sent with a delta
    reason: FinishReason | None = None  # set once the choice ended

    def delta(self, text: str, index: int) -> TextDelta:
        released, self.logprobs = tuple(self.logprobs), []
        num_tokens, self.num_unreleased_tokens = self.num_unreleased_tokens, 0
        return TextDelta(text, index, released, num_tokens)


def _push_tokens(text: TextStream, token_ids: list[int]) -> tuple[StreamDelta, int]:
    """One output's tokens into the choice's text -> (the delta, how many tokens the answer keeps). An output
    of several tokens (speculative decoding) is pushed one token at a time, so a stop string ends the answer,
    its usage and its logprobs at the token that completed it, as it does when tokens come one by one."""
    if len(token_ids) == 1:
        return text.push(token_ids), 1
    parts = []
    for used, token_id in enumerate(token_ids, 1):
        delta = text.push([token_id])
        parts.append(delta.text)
        if delta.stopped:
            return StreamDelta("".join(parts), True), used
    return StreamDelta("".join(parts), False), len(token_ids)
