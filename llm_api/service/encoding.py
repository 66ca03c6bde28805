"""The one protocol every output format implements over the service's event stream.

``ModelService.generate`` yields, per request: text deltas of each choice (with their tokens' logprobs
when asked for), one choice end per choice, then one end of the request (complete, or an error). An
``AnswerEncoder`` turns those events into the bytes its client reads; the native stream
(``llm_api.protocols.native.encoder.NativeStream``), OpenAI chat and completions
(``llm_api.protocols.common.openai_call.OpenAICall``)
and the Responses API (``llm_api.protocols.responses.encoder``) implement it, and ``llm_api.service.answer.encoded_parts``
is the one driver that feeds any of them. Each method returns the text to send now ("" when nothing is
due: a non-streamed answer holds everything for ``finish``):

* ``delta(text, index, logprobs, num_tokens)``: new text of choice ``index`` (``num_tokens``: the generated
  tokens it completes, 0 when not known);
* ``choice_finish(index, reason, num_generated_tokens, stop_sequence)``: choice ``index`` ended
  (``stop_sequence``: the stop string that ended it, if one did);
* ``finish(reason, num_prompt_tokens, num_generated_tokens, num_cached_tokens)``: the request is
  complete (choice 0's reason; ``num_cached_tokens``: the prompt tokens the engine found in its prefix
  cache); the last payload of a 200 answer (the whole answer when nothing was streamed);
* ``fail(error)``: the request broke after the encoder produced output: the format's in-band error ending;
* ``refusal(error)``: the request failed before anything was sent: the error body the edge sends with
  ``error.status``.

``content_type`` is the answer's media type (it may depend on the request: SSE when streamed).
"""

from __future__ import annotations

from typing import Protocol

from llm_api.engine.request import FinishReason
from llm_api.errors import ApiError
from llm_api.text.logprobs import LogprobItem


class AnswerEncoder(Protocol):
    @property
    def content_type(self) -> str: ...

    def delta(self, text: str, index: int = 0, logprobs: tuple[LogprobItem, ...] = (), num_tokens: int = 0) -> str: ...

    def choice_finish(self, index: int, reason: FinishReason, num_generated_tokens: int = 0,
                      stop_sequence: str | None = None) -> str: ...

    def finish(self, reason: FinishReason, num_prompt_tokens: int, num_generated_tokens: int,
               num_cached_tokens: int = 0) -> str: ...

    def fail(self, error: ApiError) -> str: ...

    def refusal(self, error: ApiError) -> str: ...
