"""The Responses API's answer encoder (``ResponsesCall``): a Response object, or typed server-sent events, and
what the store needs (``response_json``, ``conversation``, ``continue_from``); ``translate`` has the contract."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from llm_api.engine.request import FinishReason
from llm_api.errors import ApiError
from llm_api.protocols.common.openai import JSON_CONTENT_TYPE, SSE_CONTENT_TYPE
from llm_api.protocols.responses.schema import check_call_ids
from llm_api.text.logprobs import LogprobItem
from llm_api.text.reasoning import AnswerText, ReasoningFormat, ReasoningParser, ReasoningText
from llm_api.text.tools import ToolCallDelta, ToolCallParser, ToolFormat


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


@dataclass
class ResponsesCall:
    """One accepted /v1/responses call: the AnswerEncoder of its answer and what the store needs.

    ``input_turns``: the new input as chat turns; ``settings``: the request's settings the Response
    object echoes. Built by ``parse_responses``."""

    model: str
    stream: bool
    store: bool = True
    background: bool = False  # answered at once (status queued) and run on; polled with GET
    tool_format: ToolFormat | None = None
    previous_response_id: str | None = None
    reasoning_format: ReasoningFormat | None = None  # a reasoning model's: the think block is a reasoning item
    instructions: str | None = None
    input_turns: list[dict] = field(default_factory=list)
    input_items: list = field(default_factory=list)  # the parsed input items (call ids are checked on them)
    settings: dict = field(default_factory=dict)
    id: str = field(default_factory=lambda: _new_id("resp_"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    prior_turns: list[dict] = field(default_factory=list)  # a stored conversation this call continues
    _items: list[dict] = field(default_factory=list)  # the output items, in order (updated in place)
    _open: dict | None = None  # the item text or arguments are being added to
    _sequence: int = 0
    _started: bool = False
    _parser: ToolCallParser | None = None
    _thinking: ReasoningParser | None = None  # splits the think block off first (a reasoning model)
    _num_reasoning_tokens: int = 0  # generated tokens whose text was the think block (its tags included)
    _num_unsorted_tokens: int = 0  # tokens of text the reasoning parser holds back, not yet known to be either
    _pieces: list[str] = field(default_factory=list)  # the open item's text or arguments (joined at its end)
    _status: str = "in_progress"
    _incomplete_reason: str | None = None
    _error: dict | None = None
    _usage: dict | None = None
    _completed_at: int | None = None

    # -- the store's hooks ------------------------------------------------------------------------

    def continue_from(self, prior_turns: list[dict]) -> None:
        """This call continues a stored conversation (``previous_response_id``): ``prior_turns`` are what
        ``conversation()`` returned for that response (stored again with this answer). Raises ApiError (400)
        when a function_call_output answers no call of the conversation."""
        check_call_ids(prior_turns, self.input_items)
        self.prior_turns = list(prior_turns)

    def prompt_turns(self) -> list[dict]:
        """The chat turns this call's prompt renders: its instructions, the prior turns, the new input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        return system + self.prior_turns + self.input_turns

    def output_items(self) -> list[dict]:
        """The answer's output items (message and function_call items) as in the Response object, once
        ``finish`` or ``fail`` ran."""
        return [dict(item) for item in self._items]

    def response_json(self) -> dict:
        """The Response object as it stands (complete after ``finish`` or ``fail``)."""
        return self._response()

    def conversation(self) -> list[dict]:
        """The conversation to store for a later ``previous_response_id``: the prior turns, this input and
        the answer, as chat turns (no instructions: a continuation brings its own)."""
        answer: list[dict] = []
        reasoning = None  # the think block, for the assistant turn that follows it (interleaved thinking)
        for item in self._items:
            if item["type"] == "reasoning":
                reasoning = item["content"][0]["text"]
                continue
            if item["type"] == "message":
                answer.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
                continue
            try:
                arguments: Any = json.loads(item["arguments"])
            except ValueError:  # a call cut short by the token limit
                arguments = item["arguments"]
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                             "arguments": arguments}}
            if answer and answer[-1]["role"] == "assistant":
                answer[-1].setdefault("tool_calls", []).append(call)
            else:
                answer.append({"role": "assistant", "content": "", "tool_calls": [call]})
        if reasoning is not None:
            if not answer:  # cut inside the reasoning: an assistant turn of thinking only
                answer.append({"role": "assistant", "content": ""})
            answer[0]["reasoning_content"] = reasoning
        return self.prior_turns + self.input_turns + answer

    # -- AnswerEncoder ----------------------------------------------------------------------------

    @property
    def content_type(self) -> str:
        return SSE_CONTENT_TYPE if self.stream else JSON_CONTENT_TYPE

    def delta(self, text: str, index: int = 0, logprobs: tuple[LogprobItem, ...] = (), num_tokens: int = 0) -> str:
        out = self._start()
        if self.reasoning_format is None:
            return out + self._answer(text) if text else out
        if self._thinking is None:
            self._thinking = ReasoningParser(self.reasoning_format)
        self._num_unsorted_tokens += num_tokens
        if not text:
            return out
        thinking = self._thinking
        was_ended = thinking.reasoning_ended
        events = thinking.push(text)
        self._sort_tokens(events, thinking.in_reasoning or thinking.reasoning_ended and not was_ended)
        return out + self._split(events)

    def _sort_tokens(self, events: list[ReasoningText | AnswerText], in_reasoning: bool) -> None:
        """The tokens of the text just pushed (and of text held before it) are reasoning tokens when it gave
        reasoning text, or is still inside (or just closed) the think block; answer tokens when it gave
        answer text only; else the parser holds it all back and the next text decides."""
        if in_reasoning or any(isinstance(e, ReasoningText) for e in events):
            self._num_reasoning_tokens += self._num_unsorted_tokens
            self._num_unsorted_tokens = 0
        elif events:
            self._num_unsorted_tokens = 0

    def _split(self, events: list[ReasoningText | AnswerText]) -> str:
        return "".join(self._answer(e.text) if isinstance(e, AnswerText) else self._reasoning(e.text) for e in events)

    def _answer(self, text: str) -> str:
        if self.tool_format is None:
            return self._text(text)
        if self._parser is None:
            self._parser = ToolCallParser(self.tool_format)
        return self._parsed(self._parser.push(text))

    def choice_finish(self, index: int, reason: FinishReason, num_generated_tokens: int = 0,
                      stop_sequence: str | None = None) -> str:
        return ""  # one choice: everything ends in finish

    def finish(self, reason: FinishReason, num_prompt_tokens: int, num_generated_tokens: int,
               num_cached_tokens: int = 0) -> str:
        out = self._start()
        if self._thinking is not None:
            events = self._thinking.finish()
            self._sort_tokens(events, False)
            out += self._split(events)
        if self._parser is not None:
            out += self._parsed(self._parser.finish())
        cut = reason is FinishReason.LENGTH
        out += self._close("incomplete" if cut else "completed")
        self._status = {FinishReason.LENGTH: "incomplete", FinishReason.ABORT: "cancelled"}.get(reason, "completed")
        self._incomplete_reason = "max_output_tokens" if cut else None
        if self._status == "completed":
            self._completed_at = int(time.time())
        self._usage = {"input_tokens": num_prompt_tokens, "output_tokens": num_generated_tokens,
                       "total_tokens": num_prompt_tokens + num_generated_tokens,
                       # cached: the prompt tokens the engine found in its prefix cache (cache_write_tokens,
                       # which the openai package requires, is a billing figure: 0)
                       "input_tokens_details": {"cached_tokens": num_cached_tokens, "cache_write_tokens": 0},
                       "output_tokens_details": {"reasoning_tokens": min(self._num_reasoning_tokens,
                                                                         num_generated_tokens)}}
        if not self.stream:
            return json.dumps(self._response(), ensure_ascii=False)
        kind = "response.completed" if self._status == "completed" else "response.incomplete"
        return out + self._event(kind, response=self._response())

    def fail(self, error: ApiError) -> str:
        """An error after the answer began: in a stream, ``error`` then ``response.failed``. A cancel (the
        service ends a cancelled request with its 499 ``cancelled`` error) is no failure: the response is
        ``cancelled``, as the docs say, and a stream ends with ``response.incomplete``."""
        if error.code == "cancelled":
            self._status, self._error = "cancelled", None
            if not self.stream:
                return json.dumps(self._response(), ensure_ascii=False)
            out = self._start() + self._close("incomplete")
            return out + self._event("response.incomplete", response=self._response())
        self._status = "failed"
        self._error = {"code": "server_error" if error.status >= 500 else "invalid_prompt", "message": error.message}
        if not self.stream:
            return json.dumps(self._response(), ensure_ascii=False)
        out = self._start() + self._close("incomplete", events=False)
        # OpenAI's shape (fields at the top). OpenResponses' schema nests them in an ``error`` object, but
        # the openai package raises on any event whose data has an ``error`` key instead of yielding it.
        out += self._event("error", code=error.code, message=error.message, param=error.param)
        return out + self._event("response.failed", response=self._response())

    def refusal(self, error: ApiError) -> str:
        return error.openai_text()

    # -- events -----------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def _start(self) -> str:
        if self._started:
            return ""
        self._started = True
        if not self.stream:
            return ""
        return (self._event("response.created", response=self._response())
                + self._event("response.in_progress", response=self._response()))

    def _parsed(self, events: list[str | ToolCallDelta]) -> str:
        out = ""
        for event in events:
            if isinstance(event, str):
                out += self._text(event)
            elif event.id is not None:
                out += self._close("completed")
                item = {"id": _new_id("fc_"), "type": "function_call", "status": "in_progress", "arguments": "",
                        "call_id": event.id, "name": event.name}
                out += self._add(item) + self._arguments(event.arguments)
            else:
                out += self._arguments(event.arguments)
        return out

    def _add(self, item: dict) -> str:
        self._items.append(item)
        self._open = item
        return self._event("response.output_item.added", output_index=len(self._items) - 1, item=dict(item)) \
            if self.stream else ""

    def _reasoning(self, text: str) -> str:
        """Text of the think block: a reasoning item (one reasoning_text part), before the answer's items."""
        out = ""
        item = self._open
        if item is None or item["type"] != "reasoning":
            out += self._close("completed")
            item = {"id": _new_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            out += self._add(item)
            item["content"].append({"type": "reasoning_text", "text": ""})
            if self.stream:
                out += self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self._items) - 1, content_index=0,
                                   part={"type": "reasoning_text", "text": ""})
        self._pieces.append(text)
        if self.stream:
            out += self._event("response.reasoning_text.delta", item_id=item["id"],
                               output_index=len(self._items) - 1, content_index=0, delta=text)
        return out

    def _text(self, text: str) -> str:
        out = ""
        item = self._open
        if item is None or item["type"] != "message":
            out += self._close("completed")
            item = {"id": _new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            out += self._add(item)  # (the added event shows it with no content yet, as OpenAI's)
            item["content"].append(_output_text(""))
            if self.stream:
                out += self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self._items) - 1, content_index=0, part=_output_text(""))
        self._pieces.append(text)
        if self.stream:
            out += self._event("response.output_text.delta", item_id=item["id"],
                               output_index=len(self._items) - 1, content_index=0, delta=text, logprobs=[])
        return out

    def _arguments(self, piece: str) -> str:
        if not piece:
            return ""
        assert self._open is not None and self._open["type"] == "function_call"  # (the parser named the call first)
        self._pieces.append(piece)
        if not self.stream:
            return ""
        return self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                           output_index=len(self._items) - 1, delta=piece)

    def _close(self, status: str, events: bool = True) -> str:
        """The open item ends with ``status`` (a call the parser did not see complete: incomplete)."""
        item, self._open = self._open, None
        if item is None:
            return ""
        text = "".join(self._pieces)
        self._pieces = []
        if item["type"] == "function_call":
            item["arguments"] = text
        else:
            item["content"][0]["text"] = text
        if item["type"] == "function_call":
            complete = self._parser is not None and any(
                c.id == item["call_id"] and c.complete for c in self._parser.calls)
            status = status if complete else "incomplete"
        item["status"] = status
        if not (self.stream and events):
            return ""
        output_index = len(self._items) - 1
        out = ""
        if item["type"] == "message":
            part = item["content"][0]
            out += self._event("response.output_text.done", item_id=item["id"], output_index=output_index,
                               content_index=0, text=part["text"], logprobs=[])
            out += self._event("response.content_part.done", item_id=item["id"], output_index=output_index,
                               content_index=0, part=dict(part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out += self._event("response.reasoning_text.done", item_id=item["id"], output_index=output_index,
                               content_index=0, text=part["text"])
            out += self._event("response.content_part.done", item_id=item["id"], output_index=output_index,
                               content_index=0, part=dict(part))
        else:
            out += self._event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=output_index, name=item["name"], arguments=item["arguments"])
        return out + self._event("response.output_item.done", output_index=output_index, item=_copy(item))

    def _response(self) -> dict:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": self._completed_at,
            "status": self._status,
            "error": self._error,
            "incomplete_details": {"reason": self._incomplete_reason} if self._incomplete_reason else None,
            "model": self.model,
            "output": [_copy(item) for item in self._items] if self._status != "in_progress" else [],
            "usage": self._usage,
            **self.settings,
        }


def _output_text(text: str) -> dict:
    """An output_text part (no annotations are made and no logprobs returned here: both empty)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(item: dict) -> dict:
    if item["type"] in ("message", "reasoning"):
        return {**item, "content": [dict(p) for p in item["content"]]}
    return dict(item)


class Replay:
    """The encoder a reader of a background response's event log answers with (``route._replay``): its
    events were written by the response's own encoder; if this reader's stream breaks, its own ``error``
    event ends it (numbered after the last event of the log), and the response runs on."""

    content_type = SSE_CONTENT_TYPE

    def __init__(self, log: Any):
        self._log = log

    def delta(self, text: str, index: int = 0, logprobs: tuple = (), num_tokens: int = 0) -> str:
        return ""

    def choice_finish(self, index: int, reason: FinishReason, num_generated_tokens: int = 0,
                      stop_sequence: str | None = None) -> str:
        return ""

    def finish(self, reason: FinishReason, num_prompt_tokens: int, num_generated_tokens: int,
               num_cached_tokens: int = 0) -> str:
        return ""

    def fail(self, error: ApiError) -> str:
        event = {"type": "error", "sequence_number": self._log.last_sequence_number + 1, "code": error.code,
                 "message": error.message, "param": error.param}
        return f"event: error\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def refusal(self, error: ApiError) -> str:
        return error.openai_text()
