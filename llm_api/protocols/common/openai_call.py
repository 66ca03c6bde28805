"""The encoder of OpenAI chat completions and completions (``OpenAICall``): one class, its ``kind`` picks
the shape (chat's ``message`` / ``delta`` with roles, tool calls and reasoning; completions' ``text`` with
its logprobs' offsets). ``llm_api.protocols.chat`` and ``llm_api.protocols.completions`` build it; the
wire format is described in their ``translate`` modules.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from llm_api.engine.request import FinishReason
from llm_api.errors import ApiError
from llm_api.protocols.common.openai import JSON_CONTENT_TYPE, SSE_CONTENT_TYPE, sse as _sse
from llm_api.text.logprobs import LogprobItem, openai_chat_logprobs, openai_completion_logprobs
from llm_api.text.reasoning import AnswerText, ReasoningFormat, ReasoningParser, ReasoningText
from llm_api.text.tools import ToolCallDelta, ToolCallParser, ToolFormat


@dataclass
class OpenAICall:
    """One accepted completions/chat call: what the client asked for and how to encode our answer.

    Per choice (``index``), in the order the service reports them: its text deltas (with their tokens'
    logprobs when asked for), then its end (``choice_finish``); ``finish`` once all ended. With tools,
    every choice's text goes through its own ``ToolCallParser``: content comes out as content, calls as
    ``tool_calls`` (streamed in pieces), and a choice that made a call ends with ``tool_calls``. Logprobs
    of text the parser holds back ride on the next chunk of that choice."""

    kind: str  # "completions" | "chat"
    model: str
    stream: bool
    include_usage: bool
    n: int = 1
    with_logprobs: bool = False
    tool_format: ToolFormat | None = None  # set when the call has tools: the answer's calls are parsed
    reasoning_format: ReasoningFormat | None = None  # set for a reasoning model's chat: the think block is split
    marker: str = ""  # the native end-of-stream marker, kept out of refusals here too (no error ever holds it)
    service_tier: str | None = None  # chat: the tier the request named, echoed in every chunk and answer
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    _text: dict[int, list[str]] = field(default_factory=dict)  # choice -> its content so far (not streaming)
    _logprobs: dict[int, list[dict]] = field(default_factory=dict)  # choice -> rendered logprobs not yet sent
    _num_chars: dict[int, int] = field(default_factory=dict)  # choice -> characters generated (text_offset)
    _reasons: dict[int, str] = field(default_factory=dict)  # choice -> finish reason, once ended
    _tool_parsers: dict[int, ToolCallParser] = field(default_factory=dict)
    _reasoning_parsers: dict[int, ReasoningParser] = field(default_factory=dict)
    _reasoning: dict[int, list[str]] = field(default_factory=dict)  # choice -> its reasoning so far (not streaming)
    _sent_role: set[int] = field(default_factory=set)

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.id

    @property
    def content_type(self) -> str:
        return SSE_CONTENT_TYPE if self.stream else JSON_CONTENT_TYPE

    def delta(self, text: str, index: int = 0, logprobs: tuple[LogprobItem, ...] = (), num_tokens: int = 0) -> str:
        """New text of choice ``index`` (and the logprobs of its tokens) -> what to send now ("" for a
        non-streaming call, which answers at the end)."""
        if not text and not logprobs:
            return ""
        rendered = self._render_logprobs(index, text, logprobs)
        if rendered is not None:
            self._logprobs.setdefault(index, []).append(rendered)
        if self.reasoning_format is None:
            return self._answer(index, text)
        parser = self._reasoning_parsers.get(index)
        if parser is None:
            parser = self._reasoning_parsers[index] = ReasoningParser(self.reasoning_format)
        return self._reasoning_events(index, parser.push(text))

    def _answer(self, index: int, text: str) -> str:
        if self.tool_format is None:
            return self._content(index, text)
        return self._events(index, self._tool_parser(index).push(text))

    def _reasoning_events(self, index: int, events: list[ReasoningText | AnswerText]) -> str:
        out = ""
        for event in events:
            if isinstance(event, AnswerText):
                out += self._answer(index, event.text)
            elif not self.stream:
                self._reasoning.setdefault(index, []).append(event.text)
            else:
                delta = {"reasoning": event.text, "reasoning_content": event.text}
                out += self._role_event(index) + _sse(self._chunk(index, None, None, self._take_logprobs(index), delta))
        return out

    def choice_finish(self, index: int, finish_reason: FinishReason, num_generated_tokens: int = 0,
                      stop_sequence: str | None = None) -> str:
        """Choice ``index`` ended: what its parsers still held, then its finish-reason chunk when streaming."""
        reason = finish_reason.value
        out = ""
        thinking = self._reasoning_parsers.get(index)
        if thinking is not None:
            out += self._reasoning_events(index, thinking.finish())
        parser = self._tool_parsers.get(index)
        if parser is not None:
            out += self._events(index, parser.finish())
            if parser.calls and finish_reason is FinishReason.STOP:
                reason = "tool_calls"
        self._reasons[index] = reason
        if not self.stream:
            return ""
        return out + self._role_event(index) + _sse(self._chunk(index, None, reason, self._take_logprobs(index)))

    def finish(self, finish_reason: FinishReason, num_prompt_tokens: int, num_completion_tokens: int,
               num_cached_tokens: int = 0) -> str:
        """The last payload: usage (the whole answer when not streaming); ``[DONE]`` when streaming. Choices
        not ended by ``choice_finish`` end with ``finish_reason``. ``prompt_tokens_details.cached_tokens``:
        the prompt tokens the engine found in its prefix cache."""
        out = "".join(self.choice_finish(i, finish_reason) for i in range(self.n) if i not in self._reasons)
        usage = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
                 "total_tokens": num_prompt_tokens + num_completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}
        if not self.stream:
            choices = [self._whole_choice(i) for i in range(self.n)]
            return json.dumps({**self._envelope(), "choices": choices, "usage": usage})
        if self.include_usage:
            out += _sse({**self._envelope(), "choices": [], "usage": usage})
        return out + "data: [DONE]\n\n"

    def fail(self, err: ApiError) -> str:
        """An error after the stream began: one SSE event in OpenAI's error shape, then [DONE]."""
        return _sse(err.openai_json()) + "data: [DONE]\n\n"

    def refusal(self, err: ApiError) -> str:
        return err.openai_text(self.marker)

    @property
    def _object(self) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if self.stream else "chat.completion"
        return "text_completion"

    def _envelope(self) -> dict:
        envelope = {"id": self.response_id, "object": self._object, "created": self.created, "model": self.model}
        if self.service_tier is not None:
            envelope["service_tier"] = self.service_tier
        return envelope

    def _tool_parser(self, index: int) -> ToolCallParser:
        parser = self._tool_parsers.get(index)
        if parser is None:
            assert self.tool_format is not None  # (delta() comes here only for a call with tools)
            parser = self._tool_parsers[index] = ToolCallParser(self.tool_format)
        return parser

    def _events(self, index: int, events: list[str | ToolCallDelta]) -> str:
        out = ""
        for event in events:
            if isinstance(event, str):
                out += self._content(index, event)
            elif self.stream:
                call = {"index": event.index, "function": {"arguments": event.arguments}}
                if event.id is not None:
                    call = {"index": event.index, "id": event.id, "type": "function",
                            "function": {"name": event.name, "arguments": event.arguments}}
                out += self._role_event(index) + _sse(self._chunk(index, None, None, self._take_logprobs(index),
                                                                  {"tool_calls": [call]}))
        return out

    def _content(self, index: int, text: str) -> str:
        if not self.stream:
            self._text.setdefault(index, []).append(text)
            return ""
        return self._role_event(index) + _sse(self._chunk(index, text, None, self._take_logprobs(index)))

    def _render_logprobs(self, index: int, text: str, items: tuple[LogprobItem, ...]) -> dict | None:
        if not self.with_logprobs:
            return None
        offset = self._num_chars.get(index, 0)
        self._num_chars[index] = offset + len(text)
        if self.kind == "chat":
            return openai_chat_logprobs(list(items))
        return openai_completion_logprobs(list(items), offset)

    def _take_logprobs(self, index: int) -> dict | None:
        """The logprobs of choice ``index`` not sent yet, as one object (None: not asked for)."""
        if not self.with_logprobs:
            return None
        parts = self._logprobs.pop(index, [])
        if not parts and self.stream:
            return None
        if self.kind == "chat":
            return {"content": [entry for part in parts for entry in part["content"]], "refusal": None}
        return {key: [x for part in parts for x in part[key]]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}

    def _whole_choice(self, index: int) -> dict:
        text = "".join(self._text.get(index, ()))
        logprobs = self._take_logprobs(index)
        reason = self._reasons.get(index)
        if self.kind != "chat":
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        message: dict = {"role": "assistant", "content": text}
        parser = self._tool_parsers.get(index)
        if parser is not None and parser.calls:
            message = {"role": "assistant", "content": text or None,
                       "tool_calls": [c.to_openai() for c in parser.calls]}
        if self.reasoning_format is not None:
            reasoning = "".join(self._reasoning.get(index, ())) or None
            if reasoning is not None and not text:
                message["content"] = None  # the output ended inside the reasoning (vLLM's answer too)
            message["reasoning"] = message["reasoning_content"] = reasoning
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def _chunk(self, index: int, text: str | None, reason: str | None, logprobs: dict | None,
               delta: dict | None = None) -> dict:
        if self.kind == "chat":
            if delta is None:
                delta = {"content": text} if text is not None else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        chunk = {**self._envelope(), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI's shape: usage only on the extra last chunk
        return chunk

    def _role_event(self, index: int) -> str:
        # A chat stream opens each choice with the assistant role (what OpenAI sends first); once per choice.
        if self.kind != "chat" or index in self._sent_role:
            return ""
        self._sent_role.add(index)
        chunk = {**self._envelope(), "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]}
        return _sse(chunk)
