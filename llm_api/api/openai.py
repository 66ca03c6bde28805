"""The OpenAI-compatible API: request translation and response encoding (no TorchServe here; the paths
are in the one route table, ``llm_api.protocols.table``). Contract:

* ``POST v1/completions`` and ``POST v1/chat/completions``: the body (JSON bytes) is validated by
  ``parse_call`` into a ``GenerateRequest`` (our native request) plus an ``OpenAICall`` that knows how
  to encode the answer. The parameters OpenAI clients send are accepted (``model``, ``prompt`` /
  ``messages``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``n`` (1 to
  MAX_NUM_SEQS), ``presence_penalty`` / ``frequency_penalty`` (-2 to 2), ``logit_bias`` (token id ->
  -100 to 100, ids below the vocabulary size), ``logprobs`` (chat: true/false with ``top_logprobs`` 0 to
  20; completions: 0 to 5), ``stop``, ``seed``, ``stream``, ``stream_options.include_usage``, ``user``,
  and vLLM's extra ``ignore_eos``: true/false, clients send it in ``extra_body``; the answer then runs to
  the token limit, finish reason ``length``; refused with ``response_format`` or a tool grammar, as natively);
  parameters we cannot honour are refused by name rather than silently ignored. ``best_of`` and ``suffix``
  (completions) are taken only at their neutral values (null or 1, null or ""). What ``n``, the
  token limit, the logprobs and the prompt may cost together is bounded by MAX_REQUEST_WORK
  (``llm_api.api.request.request_work``): a request over it gets 400 ``work_limit_exceeded`` naming them.
* Completions for evaluation harnesses (lm-eval's ``local-completions``): ``prompt`` is a string, a list
  of token ids, or a list of either (each prompt runs as its own request; prompt p's choice i is choice
  ``p * n + i``, as OpenAI numbers them; prompts x n at most MAX_NUM_SEQS). ``echo``: each choice's text
  begins with the prompt, and with ``logprobs`` its logprobs with the prompt tokens' (the first token's
  ``null``; computed by the engine over the whole prompt: ``SamplingParams.prompt_logprobs``); with echo,
  ``max_tokens`` may be 0 (the prompt alone, finish reason ``length``), and the token that ended the answer
  keeps its logprob entry (a harness counts prompt + sampled entries).
* ``n`` > 1: every choice and chunk carries its ``index``; a stream interleaves the choices' chunks, each
  choice ends with its own ``finish_reason`` chunk; ``usage`` counts the tokens of all choices. With a
  ``seed``, choice 0 is what n = 1 would give and the others are seeded from it (distinct, reproducible).
* logprobs (``llm_api.api.logprobs``): with the text they belong to, in every chunk of a stream and in
  the answer's choices (chat: ``logprobs.content``; completions: ``tokens``, ``token_logprobs``,
  ``top_logprobs``, ``text_offset``).
* Structured output and tools (chat): ``response_format`` (``text``, ``json_object``, ``json_schema``)
  becomes a grammar the answer must follow (``llm_api.api.constraints``). ``tools`` are rendered by the
  model's chat template and, with ``tool_choice`` ``auto`` (the default with tools), ``required`` or a
  named function, the answer runs under the tool grammar of the model's format (``llm_api.api.tools``);
  ``none`` renders no tools and allows no call. A template without a tool format (the embedded SmolLM2)
  gets every choice in the generic form (the tools listed in a system block, a call decoded as
  ``{"name", "arguments"}`` under the tool's schema; with ``auto`` the model answers in text or starts a
  call; GENERIC_TOOL_CHOICE_AUTO=false refuses ``auto`` there, as vLLM without a tool parser). With
  ``response_format`` beside tools, ``auto`` answers in text that follows the format or with calls, and
  a forced call ignores the format (OpenAI's rule). Calls in the answer are parsed into ``tool_calls``
  (streamed as ``delta.tool_calls`` with the arguments in pieces) and the finish reason is
  ``tool_calls``. Messages may carry a conversation's earlier calls: assistant ``tool_calls`` and
  ``role: "tool"`` results (``tool_call_id``).
* Chat fields the openai package and agent frameworks send, accepted: ``store`` and ``metadata`` (at most
  16 string pairs; nothing is stored: a chat completion cannot be read back, use the Responses API's
  ``store`` for that), ``service_tier`` (echoed in the answer and every chunk; every request runs alike),
  ``modalities`` (``["text"]`` only), ``prediction`` (``{"type": "content", "content"}``; not used to draft:
  the n-gram drafter already proposes from the prompt). Any other unknown field is a 400 naming it.
* Reasoning models (``llm_api.api.reasoning``): ``chat_template_kwargs`` (an object of at most 16
  identifier keys and 8 KiB of JSON) are extra variables of the chat template's render;
  ``reasoning_effort`` (none | minimal | low | medium | high | xhigh) reaches the template as the variable
  ``reasoning_effort``, and "none" also as ``enable_thinking`` false (Qwen3's switch); a kwarg that
  contradicts it is refused. When the model has a reasoning parser (``Limits.reasoning_format``), each
  choice's text is split first: the think block goes out as ``reasoning`` and ``reasoning_content``
  (both names, the same text; ``delta.reasoning`` / ``delta.reasoning_content`` when streaming), only the
  answer as ``content`` (null when the output ended inside the reasoning) and through the tool-call
  parser; the structured-output grammar applies to the answer only. Assistant messages may carry
  ``reasoning`` or ``reasoning_content`` (the same text if both): the template gets it as
  ``reasoning_content``.
* ``GET v1/models``: ``models_list``. ``GET v1/health``: see ``llm_api.service.metrics.Health``.
* Streaming answers are server-sent events (``text/event-stream``): one ``data: {chunk}`` per text
  delta, a last chunk carrying ``finish_reason`` (and ``usage`` when asked for), then ``data: [DONE]``.
  Non-streaming answers are one JSON object with ``usage``.
* Every error is an ``ApiError`` rendered as ``{"error": {"message", "type", "param", "code"}}`` with
  its HTTP status; after a stream began, the error is an SSE event of that shape, followed by
  ``data: [DONE]`` (the openai client raises ``APIError`` on it).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Collection, Iterable, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from llm_api.api.constraints import (ToolPlan, ignore_eos_conflict, json_object_constraint, json_schema_constraint,
                                    plan_tools)
from llm_api.api.errors import ApiError, echo, model_not_found
from llm_api.api.fields import (Integer, LogitBias, Number, StopStrings, StrictFlag, StrictWholeNumber, Text,
                                field_path, first_error, is_type_error, message_of, unknown_fields)
from llm_api.api.logprobs import LogprobItem, openai_chat_logprobs, openai_completion_logprobs
from llm_api.api.reasoning import (AnswerText, ReasoningFormat, ReasoningParser, ReasoningText, answer_only,
                                   template_variables)
from llm_api.api.request import DEFAULT_MAX_NEW_TOKENS, MAX_SEED, GenerateRequest, Limits, WorkFields
from llm_api.api.tools import ToolCallDelta, ToolCallParser, ToolFormat
from llm_api.api.validation import decode_json
from llm_api.engine.request import FinishReason
from llm_api.engine.sampling_params import SamplingParams
from llm_api.structured.spec import Constraint

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"
MAX_OPENAI_STOP = 4  # OpenAI allows up to 4 stop sequences
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint
# Accepted only at the value that means "off" (what the openai client sends when a caller sets them
# explicitly to their defaults); anything else is refused, naming the parameter.
NEUTRAL_VALUES = {
    "best_of": (1, None), "suffix": (None, ""),
}
MAX_CHAT_TOP_LOGPROBS = 20
MAX_METADATA_PAIRS = 16
MAX_COMPLETION_LOGPROBS = 5
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function and schema names
TOOL_CHOICES = ("none", "auto", "required")


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

    def choice_finish(self, index: int, finish_reason: FinishReason, num_generated_tokens: int = 0) -> str:
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


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def _content_shape(value: Any) -> Any:
    if isinstance(value, list) and not all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        raise ValueError("only text parts are supported")
    return value


def _nonempty_list(value: Any) -> Any:
    if not isinstance(value, list) or not value:
        raise ValueError("must be a non-empty array")
    return value


def models_list(model_name: str, created: int, adapters: Iterable[str] = ()) -> str:
    """The base model, then each LoRA adapter with ``parent`` (and ``root``) naming the base, as vLLM lists them."""
    base = {"id": model_name, "object": "model", "created": created, "owned_by": "llm_api", "root": model_name,
            "parent": None}
    return json.dumps({"object": "list", "data": [base] + [
        {"id": name, "object": "model", "created": created, "owned_by": "llm_api", "root": model_name,
         "parent": model_name} for name in sorted(adapters)]})


def check_model(model: str, model_name: str, adapters: Collection[str] = ()) -> None:
    """404 ``model_not_found`` unless ``model`` is the base model or a served LoRA adapter."""
    if model != model_name and model not in adapters:
        raise model_not_found(model, model_name, adapters)


# -------------------------------------------------------------------------------------------------
# requests


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: Text


def _tool_name(value: str) -> str:
    if not TOOL_NAME.fullmatch(value):
        raise ValueError("must be 1 to 64 characters a-z, A-Z, 0-9, _ or -")
    return value


ToolName = Annotated[Text, AfterValidator(_tool_name)]


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: ToolName
    arguments: Text  # JSON text of an object (checked in parse_call, where the error can name it)


class ToolCallItem(BaseModel):
    """One call of an earlier assistant turn, sent back as conversation history."""

    model_config = ConfigDict(extra="forbid")

    id: Text
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Text | list[TextPart], BeforeValidator(_content_shape)] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant turns only
    tool_call_id: Text | None = None  # tool turns only: the call this result answers
    reasoning: Text | None = None  # assistant turns only: its thinking (vLLM's name)
    reasoning_content: Text | None = None  # the same (DeepSeek's name); both given: the same text

    @model_validator(mode="after")
    def _role_rules(self):
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.thinking)):
            raise ValueError(f"a {self.role} message needs 'content'" +
                             (" or 'tool_calls' or 'reasoning'" if self.role == "assistant" else ""))
        if self.role != "assistant" and (self.reasoning is not None or self.reasoning_content is not None):
            raise ValueError("only assistant messages may carry 'reasoning' or 'reasoning_content'")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages may carry 'tool_calls'")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("a tool message needs 'tool_call_id'" if self.role == "tool"
                             else "only tool messages may carry 'tool_call_id'")
        return self

    def to_turn(self) -> dict:
        """Our chat turn: text parts joined; ``developer`` (OpenAI's newer name) as the system role; calls
        with their arguments as objects (what chat templates render; parse_call checked the JSON)."""
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        turn: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        if self.thinking:
            turn["reasoning_content"] = self.thinking  # the name Qwen3's template reads
        return turn

    @property
    def thinking(self) -> str | None:
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: ToolName
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema; None: no arguments
    strict: StrictFlag | None = None  # accepted; arguments always follow the schema here


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class ResponseSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: ToolName
    description: Text | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: StrictFlag | None = None  # accepted; the answer always follows the schema here


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: ResponseSchema | None = None


def _metadata(value: Any) -> Any:
    # OpenAI's rule: at most 16 pairs, keys up to 64 characters, values strings up to 512.
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()):
        raise ValueError(f"must be an object of at most {MAX_METADATA_PAIRS} string values (keys up to 64 "
                         "characters, values up to 512)")
    return value


class Prediction(BaseModel):
    """Predicted output (OpenAI's ``prediction``): accepted; the n-gram drafter (SPECULATIVE_TOKENS) already
    proposes from the prompt, where a prediction that repeats the prompt's text is found anyway."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: Annotated[Text | list[TextPart], BeforeValidator(_content_shape)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictFlag = False


class _CallBody(BaseModel):
    """What both calls accept; parameters we cannot honour are accepted only at their neutral value."""

    model_config = ConfigDict(extra="forbid")

    model: Text
    max_tokens: StrictWholeNumber | None = None
    temperature: Number(0.0, 2.0, text_ok=False) | None = None
    top_p: Number(0.0, 1.0, low_open=True, text_ok=False) | None = None
    n: Integer(1, 128, text_ok=False) = 1
    stop: StopStrings(MAX_OPENAI_STOP) | None = None
    seed: Integer(0, MAX_SEED, text_ok=False) | None = None
    stream: StrictFlag = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    presence_penalty: Number(-2.0, 2.0, text_ok=False) | None = None
    frequency_penalty: Number(-2.0, 2.0, text_ok=False) | None = None
    logit_bias: LogitBias(text_ok=False) | None = None
    # vLLM's extension (benchmark clients send it to get outputs of a fixed length): generate past EOS
    ignore_eos: StrictFlag = False


class ChatBody(_CallBody):
    messages: Annotated[list[ChatMessage], BeforeValidator(_nonempty_list)]
    max_completion_tokens: StrictWholeNumber | None = None
    logprobs: StrictFlag | None = None
    top_logprobs: Integer(0, MAX_CHAT_TOP_LOGPROBS, text_ok=False) | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}: checked below
    parallel_tool_calls: StrictFlag | None = None
    chat_template_kwargs: Any = None  # an object of template variables: checked by template_variables
    reasoning_effort: Any = None  # one of reasoning.REASONING_EFFORTS: checked by template_variables
    # Fields the openai package and frameworks send: accepted as documented in the module docstring.
    store: StrictFlag | None = None
    metadata: Annotated[dict, BeforeValidator(_metadata)] | None = None
    service_tier: Literal["auto", "default", "flex", "priority", "scale"] | None = None
    modalities: list[Literal["text"]] | None = None
    prediction: Prediction | None = None


class CompletionBody(_CallBody):
    prompt: Any  # a string, strings, token ids or lists of token ids: checked by _prompts, which names the item
    logprobs: Integer(0, MAX_COMPLETION_LOGPROBS, text_ok=False) | None = None
    echo: StrictFlag | None = None
    best_of: Any = None
    suffix: Any = None


def parse_call(kind: str, body: Any, model_name: str, limits: Limits,
               adapters: Collection[str] = ()) -> tuple[GenerateRequest, OpenAICall]:
    """``parse_calls`` of a call with one prompt (chat, or completions of one prompt): its request and encoder."""
    requests, call = parse_calls(kind, body, model_name, limits, adapters)
    if len(requests) != 1:
        raise ApiError(400, "invalid_value", "this route takes one prompt", "prompt")
    return requests[0], call


def parse_calls(kind: str, body: Any, model_name: str, limits: Limits,
                adapters: Collection[str] = ()) -> tuple[list[GenerateRequest], OpenAICall]:
    """A completions/chat body (bytes or an already decoded object) -> our requests (one per prompt: chat has
    one, completions one per item of a list of prompts) and the encoder of the whole answer, whose choices
    are numbered prompt by prompt (prompt p's choice i is ``p * n + i``, as OpenAI numbers them). ``model``
    is the base model's name or one of the LoRA ``adapters`` (the answer names the one asked)."""
    data = _decode(body)
    model_class = ChatBody if kind == "chat" else CompletionBody
    try:
        call = model_class.model_validate(data, context={"limits": limits})
    except ValidationError as error:
        raise api_error(error) from None
    for name, neutral in NEUTRAL_VALUES.items():
        if name in data and not any(_same(data[name], v) for v in neutral):
            raise ApiError(400, "unsupported_parameter", f"'{name}' is not supported by this server (only {neutral[0]!r})",
                           name)
    check_model(call.model, model_name, adapters)
    if call.n > limits.max_n:
        raise ApiError(400, "invalid_value", f"'n' must be between 1 and {limits.max_n} (the server's MAX_NUM_SEQS: "
                       "all choices run together)", "n")
    if call.stream_options is not None and not call.stream:
        raise ApiError(400, "invalid_value", "'stream_options' is only allowed with stream=true", "stream_options")

    request = GenerateRequest(stream=True)  # the handler streams internally; the call encodes the answer
    tool_format = None
    if isinstance(call, ChatBody):
        if call.top_logprobs and not call.logprobs:
            raise ApiError(400, "invalid_value", "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (call.top_logprobs or 0) if call.logprobs else None
    else:
        logprobs = call.logprobs
    if isinstance(call, ChatBody):
        _check_tool_call_arguments(call.messages)
        _check_reasoning(call.messages)
        request.messages = [m.to_turn() for m in call.messages]
        request.template_kwargs = template_variables(call.chat_template_kwargs, call.reasoning_effort)
        output = _structured_output(call, limits)
        if isinstance(output, ToolPlan):
            request.constraint, request.tools, request.tool_prompt = output.constraint, output.tools, output.tool_prompt
            tool_format = output.format
        else:
            request.constraint = output
        if call.ignore_eos and request.constraint is not None:
            raise ignore_eos_conflict("tools" if tool_format is not None else "response_format", "invalid_value")
        if limits.reasoning_format is not None and request.constraint is not None:
            request.constraint = answer_only(limits.reasoning_format, request.constraint)
        max_default = min(DEFAULT_MAX_NEW_TOKENS, limits.max_new_tokens)
        max_tokens, param = ((call.max_completion_tokens, "max_completion_tokens") if call.max_completion_tokens
                             is not None else (call.max_tokens, "max_tokens"))
    else:
        max_default = min(DEFAULT_COMPLETION_MAX_TOKENS, limits.max_new_tokens)
        max_tokens, param = call.max_tokens, "max_tokens"
        request.echo = bool(call.echo)
        request.echo_only = request.echo and max_tokens == 0
    lowest = 0 if request.echo else 1  # (max_tokens 0 with echo: the prompt alone, as OpenAI serves it)
    if max_tokens is not None and not lowest <= max_tokens <= limits.max_new_tokens:
        raise ApiError(400, "invalid_value", f"'{param}' must be between {lowest} and {limits.max_new_tokens}" +
                       ("" if request.echo else " (0 only with 'echo')"), param)
    temperature = 1.0 if call.temperature is None else call.temperature
    request.params = SamplingParams(
        # Without max_tokens a chat call gets the native API's default (OpenAI's "until the model
        # stops" would ask the KV cache for MAX_NEW_TOKENS per request and refuse long prompts). With
        # max_tokens 0 the engine still samples the token after the prompt, and the answer drops it.
        max_new_tokens=max(1, max_tokens) if max_tokens is not None else max_default,
        temperature=temperature,
        top_p=1.0 if call.top_p is None else call.top_p,
        presence_penalty=call.presence_penalty or 0.0,
        frequency_penalty=call.frequency_penalty or 0.0,
        logit_bias=call.logit_bias or (),
        do_sample=temperature > 0.0,
        seed=call.seed,
        stop=call.stop or (),
        ignore_eos=call.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=logprobs if request.echo else None,
        n=call.n,
    )
    request.work_fields = WorkFields("n", param, "top_logprobs" if kind == "chat" else "logprobs")
    request.adapter, request.adapter_param = (None if call.model == model_name else call.model), "model"
    include_usage = call.stream_options is not None and call.stream_options.include_usage
    requests = [request]
    if isinstance(call, CompletionBody):
        prompts = _prompts(call.prompt, limits)
        if len(prompts) * call.n > limits.max_n:
            raise ApiError(400, "invalid_value", f"{len(prompts)} prompts x n={call.n} choices exceed the "
                           f"{limits.max_n} sequences a request may run together (the server's MAX_NUM_SEQS)", "prompt")
        requests = [dataclasses.replace(request, text=p, params=request.params) if isinstance(p, str) else
                    dataclasses.replace(request, token_ids=p) for p in prompts]
    return requests, OpenAICall(kind=kind, model=call.model, stream=call.stream, include_usage=include_usage,
                                n=call.n * len(requests), with_logprobs=logprobs is not None,
                                tool_format=tool_format,
                                reasoning_format=limits.reasoning_format if kind == "chat" else None,
                                service_tier=call.service_tier if isinstance(call, ChatBody) else None)


def _check_reasoning(messages: list[ChatMessage]) -> None:
    for i, message in enumerate(messages):
        if message.reasoning is not None and message.reasoning_content is not None and \
                message.reasoning != message.reasoning_content:
            param = f"messages[{i}].reasoning_content"
            raise ApiError(400, "invalid_value", f"{param!r} differs from 'messages[{i}].reasoning': send the "
                           "thinking once, in either field", param)


def _check_tool_call_arguments(messages: list[ChatMessage]) -> None:
    for i, message in enumerate(messages):
        for j, item in enumerate(message.tool_calls or ()):
            param = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                value = decode_json(item.function.arguments.encode("utf-8"), what=f"{param!r}", code="invalid_value")
            except ApiError as error:
                raise ApiError(400, error.code, error.message, param) from None
            if not isinstance(value, dict):
                raise ApiError(400, "invalid_value", f"{param!r} must be a JSON object (as text)", param)


def _structured_output(call: ChatBody, limits: Limits) -> Constraint | ToolPlan | None:
    """response_format, tools, tool_choice, parallel_tool_calls -> the response format's constraint, or the
    plan of the tools (``llm_api.api.constraints.plan_tools``: with ``auto`` a text answer follows the
    response format; a forced call ignores it, as OpenAI does), or None."""
    constraint = None
    text_schema = None  # the response format as a JSON schema (for a text answer beside tools)
    response_format = call.response_format
    if response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise ApiError(400, "missing_required_parameter", "'response_format.json_schema' is required when "
                           "'response_format.type' is json_schema", "response_format.json_schema")
        schema = response_format.json_schema.schema_
        constraint = (json_schema_constraint(schema, "response_format.json_schema.schema") if schema is not None
                      else json_object_constraint("response_format"))
        text_schema = schema if schema is not None else {"type": "object"}
    elif response_format is not None and response_format.json_schema is not None:
        raise ApiError(400, "invalid_value", "'response_format.json_schema' is only allowed with type json_schema",
                       "response_format.json_schema")
    elif response_format is not None and response_format.type == "json_object":
        constraint = json_object_constraint("response_format")
        text_schema = {"type": "object"}

    choice = _tool_choice(call.tool_choice, call.tools)
    if not call.tools or choice == "none":
        return constraint  # "none": the tools are not rendered, so no call can be made
    tools = [t.model_dump(exclude_none=True) for t in call.tools]
    return plan_tools(tools, choice, call.parallel_tool_calls, limits, text_schema)


def tool_choice_keyword(value: Any, has_tools: bool, named_form: str) -> str | None:
    """The keyword a ``tool_choice`` is (None: no value given, "none", "auto", "required"), or None when it is
    not a string (the format's named choice, which its caller reads); ``named_form`` spells that named
    choice in the refusal. Shared by chat and the Responses API, whose named choices differ."""
    if value is None:
        return "auto" if has_tools else "none"
    if not isinstance(value, str):
        return None
    if value not in TOOL_CHOICES:
        raise ApiError(400, "invalid_value", f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or "
                       f"{named_form}, got {echo(value)}", "tool_choice")
    if value != "none" and not has_tools:
        raise ApiError(400, "invalid_value", f"'tool_choice' {value} needs 'tools'", "tool_choice")
    return value


def _tool_choice(value: Any, tools: list[ToolDefinition] | None) -> str:
    """tool_choice -> "none" | "auto" | "required" | the name of the function to call."""
    keyword = tool_choice_keyword(value, bool(tools), '{"type": "function", "function": {"name": ...}}')
    if keyword is not None:
        return keyword
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if (not isinstance(value, dict) or set(value) != {"type", "function"} or value["type"] != "function"
            or set(function or ()) != {"name"} or not isinstance(name, str)):
        raise ApiError(400, "invalid_value", "'tool_choice' must be none, auto, required or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if not any(t.function.name == name for t in tools or ()):
        raise ApiError(400, "invalid_value", f"'tool_choice' names the function {echo(name)}, which is not in 'tools'",
                       "tool_choice.function.name")
    return name


def api_error(error: ValidationError) -> ApiError:
    """A pydantic validation error -> the OpenAI-shaped 400 naming the field (shared by the tokenizer routes)."""
    unknown = unknown_fields(error)
    if unknown:
        return ApiError(400, "unknown_parameter", f"Unrecognized request argument supplied: {echo(unknown[0])}",
                        unknown[0])
    detail = first_error(error)
    param = field_path(tuple(detail["loc"])) or None
    if detail["type"] == "missing":
        code = "missing_required_parameter"
    elif is_type_error(detail):
        code = "invalid_type"
    else:
        code = "invalid_value"
    return ApiError(400, code, message_of(detail), param)


def _decode(body: Any) -> dict:
    if isinstance(body, (bytes, bytearray)):
        body = decode_json(body)
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", "the body must be a JSON object", None)
    return body


def _same(value: Any, neutral: Any) -> bool:
    return type(value) is type(neutral) and value == neutral or (value is None and neutral is None) or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(neutral, (int, float))
        and not isinstance(neutral, bool) and value == neutral)


def _prompts(value: Any, limits: Limits) -> list[str | list[int]]:
    """``prompt``: a string, a list of strings, a list of token ids or a list of such lists -> the prompts,
    each a non-empty string or a non-empty list of ids below the vocabulary size (a 400 names the item)."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_token_id(x) for x in value)):
        items, params = [value], ["prompt"]
    elif isinstance(value, list) and value:
        items, params = value, [f"prompt[{i}]" for i in range(len(value))]
    else:
        raise ApiError(400, "invalid_type" if not isinstance(value, list) else "missing_required_parameter",
                       "'prompt' must be a non-empty string, a list of strings, a list of token ids or a list of "
                       "lists of token ids", "prompt")
    prompts: list[str | list[int]] = []
    for item, param in zip(items, params):
        if isinstance(item, str):
            if not item:
                raise ApiError(400, "missing_required_parameter", f"'{param}' is empty", param)
            prompts.append(item)
            continue
        if not isinstance(item, list) or not item or not all(_is_token_id(x) for x in item):
            raise ApiError(400, "invalid_type", f"'{param}' must be a non-empty string or a non-empty list of "
                           "token ids (integers)", param)
        if len(item) > limits.max_input_tokens:
            raise ApiError(400, "prompt_too_long", f"'{param}' has {len(item)} tokens; the limit is "
                           f"MAX_INPUT_TOKENS={limits.max_input_tokens}", param)
        vocab_size = limits.vocab_size
        bad = next((x for x in item if x < 0 or (vocab_size is not None and x >= vocab_size)), None)
        if bad is not None:
            raise ApiError(400, "invalid_value", f"'{param}' holds the token id {bad}, outside the vocabulary "
                           f"(0 to {(vocab_size or 0) - 1})", param)
        prompts.append(list(item))
    return prompts


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
