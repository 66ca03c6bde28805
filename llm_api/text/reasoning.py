"""Reasoning models: the ``<think>...</think>`` block split from the answer, streamed, and kept out of grammars.

Contract
- ``REASONING_PARSER`` (``llm_api.model.settings``) picks a ``ReasoningFormat``:
  ``reasoning_format(setting, tokenizer)``. ``none``: no parser (the think block, if any, stays in the
  answer); ``deepseek_r1`` / ``qwen3``: that family; ``auto`` (the default): ``detect_reasoning_format``
  reads the chat template: one that never writes ``</think>`` gets no parser; one whose generation prompt
  (rendered for a one-message chat) ends inside an opened ``<think>`` is DeepSeek-R1 style (R1 and its
  distills, QwQ); any other that writes ``</think>`` is Qwen3 style (Qwen3 and its hybrids).
- The two styles differ only in where the output starts:
  * ``deepseek_r1`` (``starts_in_reasoning``): the prompt already opened the block, so the output begins in
    the reasoning and only ``</think>`` appears (an output that repeats the opening ``<think>`` is
    accepted; it is dropped). Everything before ``</think>`` is reasoning; without it, all of it is.
  * ``qwen3``: the output is the answer unless it opens with ``<think>`` (whitespace before it allowed);
    then the block is reasoning up to ``</think>``. With ``enable_thinking`` false the template writes an
    empty block into the prompt and the output has none: all of it is the answer.
- ``ReasoningParser(format)`` splits the text as it streams: ``push(text)`` takes any piece (a tag may
  be split anywhere across pieces, held back only while it could still be one) and returns events in
  order, ``ReasoningText`` and ``AnswerText``; ``finish()`` returns what it still held. Collected, the
  events of a stream equal those of the whole text in one push. Whitespace at the start of the
  reasoning and at the start of the answer after a think block is dropped (Qwen3 writes
  ``<think>\\n`` and ``</think>\\n\\n``); other text is kept exactly. ``reasoning_ended`` says whether the
  answer part has begun.
- ``template_variables(chat_template_kwargs, effort)``: the request's extra variables of the chat template
  (``GenerateRequest.template_kwargs``): the kwargs object checked (at most ``MAX_TEMPLATE_KWARGS`` keys
  named like template variables, ``MAX_TEMPLATE_KWARGS_BYTES`` of JSON), plus the effort mapped to
  ``reasoning_effort`` (any of ``REASONING_EFFORTS``) and, for "none", ``enable_thinking`` false.
- Cut inside the reasoning (``max_tokens``, a stop string, a client cancel): all the text is reasoning and
  there is no answer text (what vLLM does: the chat message's ``content`` is null).
- ``reasoning_grammar(format, spec)``: structured output applies to the answer only. The request's
  grammar (``GrammarSpec``: JSON schema, regex, EBNF, tool structural tag) becomes one xgrammar
  structural tag: the think block (free text up to ``</think>``; for ``qwen3`` optional, opened by
  ``<think>``; for ``deepseek_r1`` already open), up to 8 spaces or newlines, then the original grammar.
  The engine and the sampler need no change: the matcher follows the whole output, but in the think
  block it allows any text but the tags (and the tokenizer's special tokens, as every grammar here).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from llm_api.errors import ApiError, echo
from llm_api.structured.spec import JSON_MAX_WHITESPACE, Constraint, GrammarError, GrammarSpec, check_limits

REASONING_PARSERS = ("none", "auto", "deepseek_r1", "qwen3")
THINK_START = "<think>"
THINK_END = "</think>"
MAX_GAP = 8  # spaces/newlines the grammar allows between </think> and the answer
_WHITESPACE = " \t\r\n"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's values
MAX_TEMPLATE_KWARGS = 16  # keys of chat_template_kwargs
MAX_TEMPLATE_KWARGS_BYTES = 8192  # its JSON text
# A jinja variable name (not starting with "_": no name that looks like a Python dunder reaches the sandbox)
TEMPLATE_KWARG_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")


@dataclass(frozen=True)
class ReasoningFormat:
    name: str  # "deepseek_r1" | "qwen3"
    starts_in_reasoning: bool  # the prompt opened the block: the output begins inside it
    start: str = THINK_START
    end: str = THINK_END


DEEPSEEK_R1 = ReasoningFormat("deepseek_r1", starts_in_reasoning=True)
QWEN3 = ReasoningFormat("qwen3", starts_in_reasoning=False)
FORMATS = {f.name: f for f in (DEEPSEEK_R1, QWEN3)}


def reasoning_format(setting: str, tokenizer) -> ReasoningFormat | None:
    """REASONING_PARSER's value -> the format the model's answers are split by (None: not split)."""
    if setting == "none":
        return None
    if setting == "auto":
        return detect_reasoning_format(tokenizer)
    return FORMATS[setting]


def detect_reasoning_format(tokenizer) -> ReasoningFormat | None:
    """The ``<think>`` family of the tokenizer's chat template (see the module docstring), or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not isinstance(template, str) or THINK_END not in template:
        return None
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                               tokenize=False)
    except Exception:  # a template that needs more than one user message: judge by its text alone
        return QWEN3
    return DEEPSEEK_R1 if _opened(prompt) else QWEN3


def _opened(prompt: str) -> bool:
    """Whether ``prompt`` ends inside a think block it opened."""
    start = prompt.rfind(THINK_START)
    return start >= 0 and prompt.find(THINK_END, start) < 0


# --------------------------------------------------------------------------------------------------
# template variables


def template_variables(kwargs: Any, effort: Any, effort_param: str = "reasoning_effort") -> dict | None:
    """``chat_template_kwargs`` and a reasoning effort (the field ``effort_param``: ``reasoning_effort`` on
    chat) -> the chat template's extra variables (None: none), or ApiError 400 naming the field. The names
    the render already uses and control-token text are refused by the PromptBuilder, which knows the
    tokenizer's."""
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise ApiError(400, "invalid_type", "'chat_template_kwargs' must be an object", "chat_template_kwargs")
        if len(kwargs) > MAX_TEMPLATE_KWARGS:
            raise ApiError(400, "invalid_value", f"'chat_template_kwargs' has {len(kwargs)} keys; at most "
                           f"{MAX_TEMPLATE_KWARGS} are allowed", "chat_template_kwargs")
        for name in kwargs:
            if not TEMPLATE_KWARG_NAME.fullmatch(name):
                raise ApiError(400, "invalid_value", f"'chat_template_kwargs' key {echo(name)} is not a template "
                               "variable name (letters, digits and _, starting with a letter, at most 64)",
                               "chat_template_kwargs")
        size = len(json.dumps(kwargs, ensure_ascii=False).encode("utf-8"))
        if size > MAX_TEMPLATE_KWARGS_BYTES:
            raise ApiError(400, "invalid_value", f"'chat_template_kwargs' is {size} bytes of JSON; at most "
                           f"{MAX_TEMPLATE_KWARGS_BYTES} are allowed", "chat_template_kwargs")
    variables = dict(kwargs or {})
    if effort is not None:
        if not isinstance(effort, str) or effort not in REASONING_EFFORTS:
            raise ApiError(400, "invalid_value", f"{effort_param!r} must be one of {', '.join(REASONING_EFFORTS)}, "
                           f"got {echo(effort)}", effort_param)
        implied = {"reasoning_effort": effort, **({"enable_thinking": False} if effort == "none" else {})}
        for name, value in implied.items():
            if name in variables and not (type(variables[name]) is type(value) and variables[name] == value):
                raise ApiError(400, "invalid_value", f"{effort_param!r} {effort} means the template variable "
                               f"{name}={json.dumps(value)}, but 'chat_template_kwargs.{name}' says otherwise",
                               effort_param)
        variables.update(implied)
    return variables or None


# --------------------------------------------------------------------------------------------------
# splitting


@dataclass(frozen=True)
class ReasoningText:
    text: str


@dataclass(frozen=True)
class AnswerText:
    text: str


ReasoningEvent = ReasoningText | AnswerText

_OPENING, _REASONING, _ANSWER_START, _ANSWER = "opening", "reasoning", "answer_start", "answer"


class ReasoningParser:
    """One choice's output -> reasoning and answer events (see the module docstring)."""

    def __init__(self, fmt: ReasoningFormat):
        self.format = fmt
        self._state = _OPENING
        self._held = ""  # text not yet given out: a possible tag prefix, or leading whitespace
        self._reasoning_begun = False  # the reasoning's leading whitespace is behind us

    @property
    def reasoning_ended(self) -> bool:
        return self._state in (_ANSWER_START, _ANSWER)

    @property
    def in_reasoning(self) -> bool:
        """Inside the think block (its opening tag seen or implied, its end not yet)."""
        return self._state == _REASONING

    def push(self, text: str) -> list[ReasoningEvent]:
        self._held += text
        events: list[ReasoningEvent] = []
        while self._held:
            before = (self._state, len(self._held))
            if self._state == _OPENING:
                self._on_opening()
            elif self._state == _REASONING:
                self._on_reasoning(events)
            elif self._state == _ANSWER_START:
                self._on_answer_start()
            else:
                events.append(AnswerText(self._held))
                self._held = ""
            if (self._state, len(self._held)) == before:
                break  # waiting for more text
        return _merged(events)

    def finish(self) -> list[ReasoningEvent]:
        """What was held back, at the end of the output."""
        held, self._held = self._held, ""
        if not held:
            return []
        if self._state == _OPENING:
            if self.format.starts_in_reasoning:
                stripped = held.lstrip(_WHITESPACE)
                return [ReasoningText(stripped)] if stripped else []
            return [AnswerText(held)]
        if self._state == _REASONING:
            return [ReasoningText(held)] if self._reasoning_begun or held.strip(_WHITESPACE) else []
        return []  # only whitespace after the block

    def _on_opening(self) -> None:
        # Waiting to see whether the output opens with <think> (after whitespace).
        stripped = self._held.lstrip(_WHITESPACE)
        if stripped.startswith(self.format.start):
            self._held = stripped[len(self.format.start):]
            self._state = _REASONING
        elif self.format.start.startswith(stripped):
            return  # whitespace or a prefix of <think> so far
        elif self.format.starts_in_reasoning:
            self._state = _REASONING
        else:
            self._state = _ANSWER

    def _on_reasoning(self, events: list) -> None:
        if not self._reasoning_begun:
            stripped = self._held.lstrip(_WHITESPACE)
            if not stripped:
                return
            self._held, self._reasoning_begun = stripped, True
        at = self._held.find(self.format.end)
        if at >= 0:
            if at:
                events.append(ReasoningText(self._held[:at]))
            self._held = self._held[at + len(self.format.end):]
            self._state = _ANSWER_START
            return
        keep = _partial_suffix(self._held, self.format.end)
        if len(self._held) > keep:
            events.append(ReasoningText(self._held[:len(self._held) - keep]))
            self._held = self._held[len(self._held) - keep:]

    def _on_answer_start(self) -> None:
        # (only reached after a think block: the answer's leading whitespace is dropped)
        self._held = self._held.lstrip(_WHITESPACE)
        if self._held:
            self._state = _ANSWER


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _merged(events: list[ReasoningEvent]) -> list[ReasoningEvent]:
    out: list[ReasoningEvent] = []
    for event in events:
        if out and type(out[-1]) is type(event):
            out[-1] = type(event)(out[-1].text + event.text)
        elif event.text:
            out.append(event)
    return out


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str]:
    """A whole output -> (its reasoning, or None when it has none; its answer)."""
    parser = ReasoningParser(fmt)
    events = parser.push(text) + parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningText))
    answer = "".join(e.text for e in events if isinstance(e, AnswerText))
    return reasoning or None, answer


# --------------------------------------------------------------------------------------------------
# grammars


def answer_only(fmt: ReasoningFormat, constraint: Constraint) -> Constraint:
    """A request's constraint applied to the answer only (its field and parts kept, for the errors)."""
    try:
        spec = reasoning_grammar(fmt, constraint.spec)
        check_limits(spec)
    except GrammarError as error:
        raise ApiError(400, "invalid_grammar", f"{constraint.param!r}: {error}", constraint.param) from None
    return Constraint(spec, constraint.param, constraint.parts)


def reasoning_grammar(fmt: ReasoningFormat, spec: GrammarSpec) -> GrammarSpec:
    """``spec`` applied to the answer only: a think block (any text but the tags), then ``spec``."""
    block: dict = {"type": "tag", "begin": "" if fmt.starts_in_reasoning else fmt.start,
                   "content": {"type": "any_text", "excludes": [fmt.start, fmt.end]}, "end": fmt.end}
    if not fmt.starts_in_reasoning:
        block = {"type": "optional", "content": block}
    gap = {"type": "regex", "pattern": f"[ \\n]{{0,{MAX_GAP}}}"}
    return GrammarSpec.structural_tag({"type": "structural_tag",
                                       "format": {"type": "sequence", "elements": [block, gap, _answer(spec)]}})


def _answer(spec: GrammarSpec) -> dict:
    """A grammar spec as one element of a structural tag."""
    if spec.kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}, "max_whitespace_cnt": JSON_MAX_WHITESPACE}
    if spec.kind == "json_schema":
        return {"type": "json_schema", "json_schema": json.loads(spec.source),
                "max_whitespace_cnt": JSON_MAX_WHITESPACE}
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.source}
    if spec.kind == "ebnf":
        return {"type": "grammar", "grammar": spec.source}
    if spec.kind == "structural_tag":
        return json.loads(spec.source)["format"]
    raise GrammarError(f"no reasoning form for a {spec.kind} grammar")
