"""Tool calls: each model family's tool-call text format, the grammar that enforces it, and its parser.

A ``ToolFormat`` is how a model family writes a call in its answer. Two are parsed:

* ``hermes`` (Hermes 2 Pro, Qwen2/2.5/3, and every template that wraps calls in ``<tool_call>``):
  ``<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>``, one block
  per call;
* ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 with JSON tool calling):
  ``{"name": "get_weather", "parameters": {"city": "Paris"}}``, one object per call.

and a third, ``json``, is this server's own generic form for a model whose template has no tool-call
format (the embedded SmolLM2): ``{"name": "get_weather", "arguments": {"city": "Paris"}}``, one call per
answer.

``detect_tool_format(tokenizer)`` picks one from the model's chat template (the text that tells the model
how to call), or None when the template renders no tools or uses another format. Such a model gets
every tool choice in the generic form (``GENERIC``): the tool definitions reach the prompt as a
system-message block (``generic_tool_prompt`` gives a ``GenericPrompt``; the template is not given
``tools``), earlier calls of the conversation are written into their assistant turns as ``Calling
name(...)`` lines and each result is headed by its function's name (``calls_as_text``), and the answer is
decoded under the generic grammar: with ``required`` or a named function only calls, with ``auto`` text or
a call started by the form's trigger; every call's arguments follow its schema. ``auto`` there is the
model's own choice between text and a call, which a model never trained on the form makes poorly: the
prompt nudges it on the last turn (after a question: call if a function can answer; after a result:
answer in text), which is what made the embedded SmolLM2 call for a weather question and then answer
from the result (``GenericPrompt``; measured, not guaranteed); operators who
would rather refuse it, as vLLM refuses ``auto`` without a tool parser, set GENERIC_TOOL_CHOICE_AUTO=false
(``llm_api.service.constraints.plan_tools``). Agent frameworks send ``auto`` by default, so a refusal broke
their loops. The generic form makes one call per answer unless ``parallel_tool_calls`` is true in so many
words (OpenAI's default, "not said", is one call here): a model never trained on the form does not know
when to stop calling, and with several calls allowed the embedded model wrote calls until ``max_tokens``
ran out (finish reason ``length`` instead of ``tool_calls``).

``tool_grammar(format, tools, choice, parallel)`` is the structural tag (xgrammar's format, compiled like
any other grammar) that every request with tools runs under: with ``auto`` the model writes free text,
and once it starts a call (the format's trigger) the call must name one of the tools and carry arguments
valid for that tool's ``parameters`` schema; with ``required`` the answer is one or more calls and
nothing else; a named function: exactly that one call. ``parallel=False`` allows one call at most. So every call the parser sees
is well formed, and the arguments of a complete call always validate.

A call's arguments are a JSON object (OpenAI's ``parameters`` is an object schema, and the parser finds
the end of a call by the object's closing brace): ``arguments_schema(parameters)`` is the schema they
follow, the tool's ``parameters`` with ``"type": "object"`` when it names no type, and raises
``ValueError`` for a schema whose ``type`` allows no object (``"string"``, ``["array", "null"]``).

``ToolCallParser`` turns the answer's text, as it streams, into events in order: content text (``str``)
and ``ToolCallDelta`` (a call's id and name first, then pieces of its arguments JSON text, exactly as the
model wrote them). The same events, collected, give the non-streamed message. Whitespace between or
around calls is not content. Text of a call cut short (``max_tokens``) before its arguments began is
returned as content; arguments already streamed stay streamed (the finish reason says ``length``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from llm_api.structured.spec import JSON_MAX_WHITESPACE, GrammarSpec

TOOL_FORMATS = ("hermes", "llama3_json", "json")
MAX_HEAD_CHARS = 256  # text between a trigger and a call's arguments (the name is at most 64 characters)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    trigger: str  # the text that starts a call
    begin: str  # the text a call opens with, up to its arguments; {name} stands for the function's name
    end: str  # the text that closes a call after its arguments
    head: re.Pattern  # matches from the trigger through the arguments key (group "name")
    separators: str  # characters allowed between calls (not content)
    call_separator: str  # what the grammar puts between two calls when the answer is only calls

    def call_begin(self, name: str) -> str:
        return self.begin.replace("{name}", name)


HERMES = ToolFormat(
    name="hermes", trigger="<tool_call>", begin='<tool_call>\n{"name": "{name}", "arguments": ',
    end="}\n</tool_call>",
    head=re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"(?P<name>[A-Za-z0-9_.-]{1,64})"\s*,\s*"arguments"\s*:\s*'),
    separators=" \t\r\n", call_separator="\n")
LLAMA3_JSON = ToolFormat(
    name="llama3_json", trigger='{"name": ', begin='{"name": "{name}", "parameters": ', end="}",
    head=re.compile(r'\{"name":\s*"(?P<name>[A-Za-z0-9_.-]{1,64})"\s*,\s*"(?:parameters|arguments)"\s*:\s*'),
    separators=" \t\r\n;", call_separator="; ")
# The generic form (no tool format in the template): the call object of the tools prompt, one per line.
GENERIC = ToolFormat(
    name="json", trigger='{"name": ', begin='{"name": "{name}", "arguments": ', end="}",
    head=re.compile(r'\{\s*"name"\s*:\s*"(?P<name>[A-Za-z0-9_.-]{1,64})"\s*,\s*"arguments"\s*:\s*'),
    separators=" \t\r\n", call_separator="\n")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, GENERIC)}


def detect_tool_format(tokenizer) -> ToolFormat | None:
    """The tool-call format of the tokenizer's chat template, or None (no tools in it, or a format that
    is not parsed here)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the one for tool use, else the default
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str) or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return LLAMA3_JSON
    return None


def arguments_schema(parameters: dict | None) -> dict:
    """The schema a call's arguments follow (see the module docstring); ValueError when ``parameters``
    cannot describe an object."""
    if parameters is None:  # OpenAI's "a function with an empty parameter list": the arguments are {}
        return {"type": "object", "properties": {}, "additionalProperties": False}
    kind = parameters.get("type")
    if kind is None:
        return {**parameters, "type": "object"}
    if kind != "object" and kind != ["object"]:
        raise ValueError("must describe a JSON object (a call's arguments are an object): its 'type' must be "
                         "\"object\"")
    return parameters


def tool_grammar(fmt: ToolFormat, tools: list[dict], choice: str | None, parallel: bool = True,
                 text_schema: dict | None = None) -> GrammarSpec:
    """The structural tag for a request's ``tools`` ([{"type": "function", "function": {...}}]).
    choice: "auto", "required", or the name of the one function to call. ``text_schema`` (auto only: the
    request's response format): the answer is either text that follows it or calls, not free text."""
    def tag(function: dict) -> dict:
        schema = arguments_schema(function.get("parameters"))
        return {"type": "tag", "begin": fmt.call_begin(function["name"]),
                "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": JSON_MAX_WHITESPACE},
                "end": fmt.end}

    functions = [t["function"] for t in tools]
    body: dict
    if choice == "auto" and text_schema is not None:
        calls: dict = {"type": "tags_with_separator", "tags": [tag(f) for f in functions], "separator": fmt.call_separator,
                 "at_least_one": True, "stop_after_first": not parallel}
        text: dict = {"type": "json_schema", "json_schema": text_schema, "max_whitespace_cnt": JSON_MAX_WHITESPACE}
        body = {"type": "or", "elements": [text, calls]}
    elif choice == "auto":
        body = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": [tag(f) for f in functions],
                "at_least_one": False, "stop_after_first": not parallel}
    elif choice == "required":
        body = {"type": "tags_with_separator", "tags": [tag(f) for f in functions], "separator": fmt.call_separator,
                "at_least_one": True, "stop_after_first": not parallel}
    else:
        body = tag(next(f for f in functions if f["name"] == choice))
    return GrammarSpec.structural_tag({"type": "structural_tag", "format": body})


# --------------------------------------------------------------------------------------------------
# the generic form's prompt (a template without a tool format)

GENERIC_PROMPT_HEAD = ("# Tools\n\nYou can call these functions. Each is written as a JSON object: its name, its "
                       "description and the JSON Schema of its arguments (\"parameters\").\n")
GENERIC_CALL_SHAPE = '{"name": <the function\'s name>, "arguments": <its arguments, a JSON object>}'


# The nudges ``auto`` adds to the conversation's last turn (GenericPrompt.apply). Measured with the embedded
# SmolLM2 (greedy, float32): with the tools block alone it never called, whatever the block said; with the
# question's nudge it called get_weather for a weather question and still answered "What is 2 + 2?" and
# "Say hello" in text. After a result it copied its earlier call as long as that call was in the
# conversation as JSON; with earlier calls written as ``Calling name(...)`` lines and the result's nudge it
# answered from the result in text (3 of 3 tries), so an agent loop ends.
AUTO_QUESTION_NUDGE = "\n\n(If one of the functions can answer this, reply with only the JSON object that calls it.)"
AUTO_RESULT_NUDGE = "\n\nNow answer the user's question in plain text."


@dataclass(frozen=True)
class GenericPrompt:
    """How the generic form shows a model without a tool format its tools: ``block``, the system-message
    block; with ``auto`` (the model chooses), a nudge on the conversation's last turn too: after the
    user's question, to call when a function can answer; after a function's result, to answer in text."""
    block: str
    auto: bool = False

    def apply(self, turns: list[dict]) -> list[dict]:
        """The turns with the block in the system turn and, with ``auto``, the last turn's nudge (the
        turns given are not changed)."""
        turns = with_tool_prompt(turns, self.block)
        last = turns[-1]
        nudge = {"user": AUTO_QUESTION_NUDGE, "tool": AUTO_RESULT_NUDGE}.get(last["role"]) if self.auto else None
        if nudge is None or not isinstance(last.get("content"), str):
            return turns
        return [*turns[:-1], {**last, "content": last["content"] + nudge}]


def generic_tool_prompt(tools: list[dict], choice: str) -> GenericPrompt:
    """What shows a model without a tool format the tools and how to call them. choice: "auto" (a call or
    a text answer), "required" or the name of the function to call."""
    lines = []
    for tool in tools:
        function = tool["function"]
        shown = {"name": function["name"]}
        for key in ("description", "parameters"):
            if function.get(key) is not None:
                shown[key] = function[key]
        lines.append(json.dumps(shown, ensure_ascii=False))
    if choice == "auto":
        ask = (f"To call a function, reply with only a JSON object:\n{GENERIC_CALL_SHAPE}\nOtherwise, and once a "
               f"function's result is in the conversation, reply in plain text.")
    elif choice == "required":
        ask = f"Answer with a call of one of these functions and nothing else, written as one JSON object:\n" \
              f"{GENERIC_CALL_SHAPE}"
    else:
        ask = (f"Answer with a call of the function {choice} and nothing else, written as one JSON object:\n"
               f'{{"name": "{choice}", "arguments": <its arguments, a JSON object>}}')
    return GenericPrompt(GENERIC_PROMPT_HEAD + "\n".join(lines) + "\n\n" + ask, auto=choice == "auto")


def with_tool_prompt(turns: list[dict], prompt: str) -> list[dict]:
    """Chat turns with ``prompt`` appended to the first turn when it is a system turn (after a blank line),
    else inserted before the others as a system turn of its own (the turns given are not changed)."""
    if turns and turns[0]["role"] == "system":
        first = turns[0]
        content = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [{**first, "content": content}, *turns[1:]]
    return [{"role": "system", "content": prompt}, *turns]


def call_as_text(name: str, arguments) -> str:
    """One earlier call as the generic form writes it into the conversation: ``Calling name(key=value)``,
    each value as JSON (arguments that are not an object: ``Calling name(<their JSON>)``)."""
    if isinstance(arguments, dict):
        shown = ", ".join(f"{key}={json.dumps(value, ensure_ascii=False)}" for key, value in arguments.items())
    else:
        shown = json.dumps(arguments, ensure_ascii=False)
    return f"Calling {name}({shown})"


def calls_as_text(turns: list[dict]) -> list[dict]:
    """Chat turns as a template without a tool format can render them: each assistant turn's earlier calls
    (``tool_calls``, arguments as objects) written into its content after its text, one ``call_as_text``
    line each, and each tool result headed by the name of the function it answers ("get_weather returned:
    ..."), so the model sees what it called and what came back (the turns given are not changed). Calls
    are not written in the JSON form the model calls in: a small model shown its own call as JSON wrote
    it again instead of answering from the result (GenericPrompt)."""
    written = []
    names: dict[str, str] = {}  # tool_call_id -> the function's name
    for turn in turns:
        calls = turn.get("tool_calls")
        if turn["role"] == "tool" and names.get(turn.get("tool_call_id") or "") and \
                isinstance(turn.get("content"), str):
            written.append({**turn, "content": f"{names[turn['tool_call_id']]} returned: {turn['content']}"})
            continue
        if not calls:
            written.append(turn)
            continue
        names.update((c.get("id") or "", c["function"]["name"]) for c in calls)
        lines = [call_as_text(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        text = "\n".join(([turn["content"]] if turn.get("content") else []) + lines)
        written.append({k: v for k, v in turn.items() if k != "tool_calls"} | {"content": text})
    return written


# --------------------------------------------------------------------------------------------------
# parsing


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # which call of the answer (0, 1, ...)
    arguments: str  # a piece of the arguments' JSON text ("" in a call's first delta)
    id: str | None = None  # set in a call's first delta only
    name: str | None = None  # set in a call's first delta only


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text, as the model wrote it
    complete: bool = False

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCallParser:
    fmt: ToolFormat
    calls: list[ToolCall] = field(default_factory=list)
    _state: str = "text"  # text | head | args | tail
    _buffer: str = ""  # text not yet turned into events
    _held_space: str = ""  # separator-only content, sent only if real content follows (and no call)
    _space_before_call: str = ""  # the held separators when a trigger came: content again if no call follows
    _depth: int = 0  # arguments: bracket depth outside strings
    _in_string: bool = False
    _escaped: bool = False
    _started: bool = False  # arguments: the opening bracket was seen

    @property
    def num_complete_calls(self) -> int:
        return sum(1 for c in self.calls if c.complete)

    def push(self, text: str) -> list[str | ToolCallDelta]:
        self._buffer += text
        events: list[str | ToolCallDelta] = []
        while self._buffer:
            before = (self._state, len(self._buffer))
            getattr(self, f"_on_{self._state}")(events)
            if (self._state, len(self._buffer)) == before:
                break  # waiting for more text
        return _merge(events)

    def finish(self) -> list[str | ToolCallDelta]:
        """The end of the answer: what is still held goes out (an unfinished call's head as content)."""
        events: list[str | ToolCallDelta] = []
        if self._state == "head":
            self._held_space = self._space_before_call
        if self._state in ("text", "head"):
            self._content(events, self._buffer, final=True)
        elif self._state == "args":
            self._argument_piece(events, self._buffer)
        self._buffer = ""
        if not self.calls and self._held_space:
            events.append(self._held_space)
        self._held_space = ""
        return _merge(events)

    # ----------------------------------------------------------------------------------------------

    def _on_text(self, events: list) -> None:
        at = self._buffer.find(self.fmt.trigger)
        if at >= 0:
            self._content(events, self._buffer[:at])
            # Separators before a call are not content (unless it turns out not to be a call).
            self._space_before_call, self._held_space = self._held_space, ""
            self._buffer = self._buffer[at:]
            self._state = "head"
            return
        keep = _partial_suffix(self._buffer, self.fmt.trigger)
        self._content(events, self._buffer[: len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]

    def _on_head(self, events: list) -> None:
        match = self.fmt.head.match(self._buffer)
        if match is None:
            if len(self._buffer) > MAX_HEAD_CHARS:  # not a call after all: its text is content
                self._held_space = self._space_before_call
                self._content(events, self._buffer[: len(self.fmt.trigger)])
                self._buffer = self._buffer[len(self.fmt.trigger):]
                self._state = "text"
            return
        call = ToolCall(new_call_id(), match.group("name"))
        self.calls.append(call)
        events.append(ToolCallDelta(len(self.calls) - 1, "", call.id, call.name))
        self._buffer = self._buffer[match.end():]
        self._state, self._depth, self._in_string, self._escaped, self._started = "args", 0, False, False, False

    def _on_args(self, events: list) -> None:
        end = None
        for i, char in enumerate(self._buffer):
            if not self._started:
                if char in "{[":
                    self._started, self._depth = True, 1
                continue
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        piece = self._buffer if end is None else self._buffer[:end]
        self._argument_piece(events, piece)
        self._buffer = self._buffer[len(piece):]
        if end is not None:
            self._state = "tail"

    def _on_tail(self, events: list) -> None:
        # The closing text, whitespace aside (the grammar writes it exactly; a model without one may not).
        expected = "".join(self.fmt.end.split())
        seen, cut = "", None
        for i, char in enumerate(self._buffer):
            if char.isspace():
                continue
            if len(seen) == len(expected) or char != expected[len(seen)]:
                cut = i  # not (or no longer) the closing text
                break
            seen += char
            if seen == expected:
                cut = i + 1
                break
        if cut is None:
            return  # the closing text so far: wait
        self.calls[-1].complete = True
        self._buffer = self._buffer[cut:]
        self._state = "text"

    def _argument_piece(self, events: list, piece: str) -> None:
        piece = piece if self.calls[-1].arguments or not piece else piece.lstrip()
        if piece:
            self.calls[-1].arguments += piece
            events.append(ToolCallDelta(len(self.calls) - 1, piece))

    def _content(self, events: list, text: str, final: bool = False) -> None:
        # Trailing separators are held until real content follows them: dropped when a call or the end
        # of an answer with calls follows, so the events do not depend on how the text was chunked.
        text = self._held_space + text
        kept = text if final else text.rstrip(self.fmt.separators)
        self._held_space = text[len(kept):]
        if final and self.calls and not kept.strip(self.fmt.separators):
            kept = ""
        if kept:
            events.append(kept)


def _partial_suffix(text: str, trigger: str) -> int:
    """Length of the longest end of ``text`` that begins ``trigger`` (it may be a call starting)."""
    for size in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-size:]):
            return size
    return 0


def _merge(events: list) -> list:
    """Adjacent content pieces, and adjacent argument pieces of one call, as one event."""
    merged: list = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, str) and isinstance(last, str):
            merged[-1] = last + event
        elif (isinstance(event, ToolCallDelta) and isinstance(last, ToolCallDelta) and event.id is None
              and last.index == event.index):
            merged[-1] = ToolCallDelta(last.index, last.arguments + event.arguments, last.id, last.name)
        else:
            merged.append(event)
    return merged
