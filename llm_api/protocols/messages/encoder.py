"""The encoder of Anthropic Messages answers (``MessagesCall``, an ``llm_api.service.encoding.AnswerEncoder``).

One answer (Anthropic has no ``n``) made of content blocks in the order the model wrote them: ``thinking``
(a reasoning model's think block, split by ``llm_api.text.reasoning``), ``text``, and ``tool_use`` (calls
parsed by ``llm_api.text.tools``; ids ``toolu_...``, ``input`` the arguments' object).

* Not streamed: one ``message`` object: ``id``, ``type``, ``role``, ``model``, ``content``, ``stop_reason``
  (``end_turn``: the model ended; ``stop_sequence`` with ``stop_sequence`` naming the string;
  ``max_tokens``; ``tool_use``: the answer made a call), ``usage``.
* Streamed (server-sent events, each ``event: <type>`` then ``data: <json>``): ``message_start`` (the
  message with empty content; ``usage.input_tokens`` the prompt's tokens) and a ``ping`` when the first
  output is due; per block ``content_block_start``, its deltas (``text_delta``, ``thinking_delta``,
  ``input_json_delta`` with the arguments' JSON text in pieces) and ``content_block_stop``; then
  ``message_delta`` (``stop_reason``, ``stop_sequence``, the final ``usage``) and ``message_stop``. A
  failure after the stream began is an ``error`` event (Anthropic's error shape), and the stream ends.
* ``usage``: ``input_tokens`` are the prompt's tokens not read from the prefix cache,
  ``cache_read_input_tokens`` those read from it (Anthropic's split: their sum is the prompt),
  ``cache_creation_input_tokens`` 0 (caching here costs nothing), ``output_tokens`` the answer's.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from llm_api.engine.request import FinishReason
from llm_api.errors import ApiError
from llm_api.protocols.common.openai import JSON_CONTENT_TYPE, SSE_CONTENT_TYPE
from llm_api.text.logprobs import LogprobItem
from llm_api.text.reasoning import AnswerText, ReasoningFormat, ReasoningParser
from llm_api.text.tools import ToolCallDelta, ToolCallParser, ToolFormat

TOOL_ID_PREFIX = "toolu_"


def event(kind: str, data: dict) -> str:
    """One server-sent event of Anthropic's stream (its ``type`` is also the event's name)."""
    return f"event: {kind}\ndata: " + json.dumps({"type": kind, **data}, ensure_ascii=False) + "\n\n"


@dataclass
class MessagesCall:
    model: str
    stream: bool
    marker: str = ""  # the native end-of-stream marker, kept out of error texts as every encoder does
    tool_format: ToolFormat | None = None  # set when the call has tools: the answer's calls are parsed
    reasoning_format: ReasoningFormat | None = None  # set for a reasoning model: its think block is split
    num_prompt_tokens: int = 0  # set by the route once admitted (message_start's usage)
    id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)
    _blocks: list[dict] = field(default_factory=list)  # the answer's blocks so far
    _arguments: list[str] = field(default_factory=list)  # per tool_use block (by call index): its JSON text
    _open: bool = False  # (streamed) the last block is started and not stopped
    _started: bool = False  # (streamed) message_start was sent
    _stop_reason: str | None = None
    _stop_sequence: str | None = None
    _tools: ToolCallParser | None = None
    _reasoning: ReasoningParser | None = None

    def __post_init__(self) -> None:
        if self.tool_format is not None:
            self._tools = ToolCallParser(self.tool_format)
        if self.reasoning_format is not None:
            self._reasoning = ReasoningParser(self.reasoning_format)

    @property
    def content_type(self) -> str:
        return SSE_CONTENT_TYPE if self.stream else JSON_CONTENT_TYPE

    # ------------------------------------------------------------------------------------------
    # the AnswerEncoder protocol

    def delta(self, text: str, index: int = 0, logprobs: tuple[LogprobItem, ...] = (), num_tokens: int = 0) -> str:
        if not text:
            return ""
        if self._reasoning is None:
            return self._answer(text)
        return self._split(self._reasoning.push(text))

    def choice_finish(self, index: int, reason: FinishReason, num_generated_tokens: int = 0,
                      stop_sequence: str | None = None) -> str:
        out = self._split(self._reasoning.finish()) if self._reasoning is not None else ""
        if self._tools is not None:
            out += self._tool_events(self._tools.finish())
        if reason is FinishReason.LENGTH:
            self._stop_reason = "max_tokens"
        elif self._tools is not None and self._tools.calls:
            self._stop_reason = "tool_use"
        elif stop_sequence is not None:
            self._stop_reason, self._stop_sequence = "stop_sequence", stop_sequence
        else:
            self._stop_reason = "end_turn"
        return out + self._close()

    def finish(self, reason: FinishReason, num_prompt_tokens: int, num_generated_tokens: int,
               num_cached_tokens: int = 0) -> str:
        out = self.choice_finish(0, reason) if self._stop_reason is None else ""
        usage = {"input_tokens": num_prompt_tokens - num_cached_tokens, "output_tokens": num_generated_tokens,
                 "cache_read_input_tokens": num_cached_tokens, "cache_creation_input_tokens": 0}
        if not self.stream:
            return json.dumps({**self._message(self._whole_blocks()), "stop_reason": self._stop_reason,
                               "stop_sequence": self._stop_sequence, "usage": usage}, ensure_ascii=False)
        out += self._start()
        out += event("message_delta", {"delta": {"stop_reason": self._stop_reason, "stop_sequence": self._stop_sequence},
                                       "usage": usage})
        return out + event("message_stop", {})

    def fail(self, error: ApiError) -> str:
        return "event: error\ndata: " + error.anthropic_text(self.marker) + "\n\n"

    def refusal(self, error: ApiError) -> str:
        return error.anthropic_text(self.marker)

    # ------------------------------------------------------------------------------------------
    # blocks

    def _split(self, events: list) -> str:
        out = ""
        for piece in events:
            out += self._answer(piece.text) if isinstance(piece, AnswerText) else self._add("thinking", piece.text)
        return out

    def _answer(self, text: str) -> str:
        if self._tools is None:
            return self._add("text", text)
        return self._tool_events(self._tools.push(text))

    def _tool_events(self, events: list[str | ToolCallDelta]) -> str:
        out = ""
        for piece in events:
            if isinstance(piece, str):
                out += self._add("text", piece)
                continue
            if piece.id is not None:  # a call's first delta: its block opens
                out += self._open_block({"type": "tool_use", "id": TOOL_ID_PREFIX + piece.id.removeprefix("call_"),
                                         "name": piece.name, "input": {}})
                self._arguments.append("")
            if piece.arguments:
                self._arguments[piece.index] += piece.arguments
                if self.stream:
                    out += self._block_delta({"type": "input_json_delta", "partial_json": piece.arguments})
        return out

    def _add(self, kind: str, text: str) -> str:
        """Text of a ``text`` or ``thinking`` block: the open one of that kind, else a new one."""
        if not text:
            return ""
        out = ""
        if not self._blocks or self._blocks[-1]["type"] != kind or (self.stream and not self._open):
            out += self._open_block({"type": "text", "text": ""} if kind == "text"
                                    else {"type": "thinking", "thinking": "", "signature": ""})
        self._blocks[-1][kind] += text
        if not self.stream:
            return out
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        return out + self._block_delta(delta)

    def _open_block(self, block: dict) -> str:
        out = self._close()
        self._blocks.append(block)
        if not self.stream:
            return out
        self._open = True
        return out + self._start() + event("content_block_start", {"index": len(self._blocks) - 1,
                                                                   "content_block": dict(block)})

    def _block_delta(self, delta: dict) -> str:
        return event("content_block_delta", {"index": len(self._blocks) - 1, "delta": delta})

    def _close(self) -> str:
        if not (self.stream and self._open):
            return ""
        self._open = False
        return event("content_block_stop", {"index": len(self._blocks) - 1})

    def _start(self) -> str:
        if self._started:
            return ""
        self._started = True
        usage = {"input_tokens": self.num_prompt_tokens, "output_tokens": 0}
        return event("message_start", {"message": {**self._message([]), "stop_reason": None, "stop_sequence": None,
                                                   "usage": usage}}) + event("ping", {})

    def _message(self, content: list[dict]) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content}

    def _whole_blocks(self) -> list[dict]:
        """The blocks of a whole answer: each call's input as the object its JSON text is ({} if the text was
        cut short: ``max_tokens`` inside a call)."""
        blocks, calls = [], 0
        for block in self._blocks:
            if block["type"] == "tool_use":
                try:
                    value = json.loads(self._arguments[calls] or "{}")
                except ValueError:
                    value = {}
                block = {**block, "input": value if isinstance(value, dict) else {}}
                calls += 1
            blocks.append(block)
        return blocks
