"""Structured-output fields of every request format -> ``Constraint`` (a grammar spec and its field).

The request formats call these with a field's validated value: a JSON schema (``response_format``'s
``json_schema.schema``, the native ``json_schema``), ``json_object``, a regex, an EBNF grammar, or a
request's tools (``tools`` / ``tool_choice``, see ``llm_api.text.tools``). Each builds the
``GrammarSpec`` and checks it against the compile-cost limits (``llm_api.structured.spec.check_limits``:
source size, string-length and repetition bounds) at once, so an over-limit grammar costs a 400 and no
compile. A schema object (a JSON schema, a tool's ``parameters``, a request's tools together) is first
measured without being written out (``source_chars``: a walk that stops once past the source limit), so a
schema of megabytes is refused after reading at most the limit's worth of it, not after ``json.dumps`` of
all of it (0.15-0.3 s of held GIL for 5.8 MB, which stalled the running streams: docs/reliability.md,
"Hostile input, by class"). What the grammar library itself rejects is found when the service compiles
the spec (off the event loop), and reported the same way: ``ApiError(400, "invalid_grammar", ...)`` with ``param`` naming
the field (``response_format``, ``json_schema``, ``regex``, ``grammar``, ``tools[i].function.parameters``).

``plan_tools(tools, choice, parallel, limits)`` is everything a request's tools decide, for any route that
takes them (chat completions; the Responses API): the ``ToolPlan`` with the grammar, the tools the prompt
carries (``GenerateRequest.tools``), the generic tools block for a template without a tool format
(``GenerateRequest.tool_prompt``) and the format the answer's calls are parsed in. On such a template every
tool choice is served in the generic form (``llm_api.text.tools.GENERIC``): ``auto`` lets the model answer
in text or make a call (refused, naming ``tool_choice``, where the server is set to refuse it:
``GENERIC_TOOL_CHOICE_AUTO=false``), and one call is made per answer unless ``parallel_tool_calls`` is
true (see ``llm_api.text.tools`` for why). With a response format, ``auto`` answers either in text that
follows the format or with calls; a forced call ignores the format (OpenAI's rule).

``ignore_eos_conflict(field, code)`` is the one refusal of ``ignore_eos`` together with a constraint, on
every route that takes both (native, chat completions, the Responses API): a grammar
decides where the answer ends, so "run past the end" has no meaning there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llm_api.errors import ApiError
from llm_api.service.request import Limits
from llm_api.structured.spec import Constraint, GrammarError, GrammarLimits, GrammarSpec, check_limits
from llm_api.text.tools import GENERIC, GenericPrompt, ToolFormat, arguments_schema, generic_tool_prompt, tool_grammar

MAX_SOURCE_CHARS = GrammarLimits().max_source_chars  # what check_limits allows a grammar's source


def grammar_refusal(param: str, error: GrammarError | str) -> ApiError:
    return ApiError(400, "invalid_grammar", f"{param!r}: {error}", param)


def ignore_eos_conflict(field: str, code: str) -> ApiError:
    """400 naming ``ignore_eos``: ``field`` (the constraint's top-level field) asked for a grammar; ``code`` is
    the route's code for a bad value (native ``invalid_parameter``, OpenAI ``invalid_value``)."""
    return ApiError(400, code, f"'ignore_eos' cannot be combined with {field!r}: the answer ends where its "
                    "grammar ends", "ignore_eos")


def source_chars(value: Any, limit: int, start: int = 0) -> int:
    """``start`` plus a lower bound of the characters in the compact JSON text of ``value`` (as
    ``GrammarSpec`` writes it: no spaces, non-ASCII kept), or any count over ``limit`` once it is past it.
    Each item counts at least what it writes (a string: its characters and two quotes; a key: those and
    a colon; an object or array: its brackets and commas; a number, true, false, null: one) and the walk
    stops as soon as the count is past the limit, so it reads at most ``limit`` items of a value of any
    size."""
    total, stack = start, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, dict):
            if len(item) > limit:  # (over the limit by its colons alone)
                return limit + 1
            total += 1 + len(item) + sum(len(k) + 3 if isinstance(k, str) else 1 for k in item)
            stack.extend(item.values())
        elif isinstance(item, list):
            if len(item) > limit:
                return limit + 1
            total += 1 + len(item)
            stack.extend(item)
        else:
            total += 1
    return total


def _source_refusal(param: str, what: str = "JSON schema") -> ApiError:
    return grammar_refusal(param, f"the {what} has more than {MAX_SOURCE_CHARS} characters; the limit is "
                           f"{MAX_SOURCE_CHARS}")


def _checked(spec_of, value, param: str) -> GrammarSpec:
    if isinstance(value, dict) and MAX_SOURCE_CHARS is not None \
            and source_chars(value, MAX_SOURCE_CHARS) > MAX_SOURCE_CHARS:
        raise _source_refusal(param)
    try:
        spec = spec_of(value)
        check_limits(spec)
    except GrammarError as error:
        raise grammar_refusal(param, error) from None
    return spec


def json_schema_constraint(schema: dict | bool | str, param: str) -> Constraint:
    return Constraint(_checked(GrammarSpec.json_schema, schema, param), param)


def json_object_constraint(param: str) -> Constraint:
    return Constraint(GrammarSpec.json_object(), param)


def regex_constraint(pattern: str, param: str) -> Constraint:
    return Constraint(_checked(GrammarSpec.regex, pattern, param), param)


def ebnf_constraint(grammar: str, param: str) -> Constraint:
    return Constraint(_checked(GrammarSpec.ebnf, grammar, param), param)


def tool_constraint(fmt: ToolFormat, tools: list[dict], choice: str, parallel: bool,
                    text_schema: dict | None = None) -> Constraint:
    """tools: [{"type": "function", "function": {"name", "parameters"?...}}]; choice: auto | required | a
    function's name. Each tool's parameters schema is a part, so a schema the library rejects is named (and
    one that allows arguments that are not an object is refused here, naming it)."""
    # Sizes first, before anything is written out: each schema (named when it alone is over the limit),
    # then the structural tag, which holds every tool's call text and schema (10,000 tools, or many
    # schemas each under the limit). The walks stop once past the limit: at most twice its worth is read.
    if MAX_SOURCE_CHARS is not None:
        chars = 0
        for i, tool in enumerate(tools):
            function = tool["function"]
            own = source_chars(function.get("parameters") or {}, MAX_SOURCE_CHARS)
            if own > MAX_SOURCE_CHARS:
                raise _source_refusal(f"tools[{i}].function.parameters")
            chars += len(fmt.call_begin(function["name"])) + len(fmt.end) + own
            if chars > MAX_SOURCE_CHARS:
                raise _source_refusal("tools", "structural tag")
    parts = []
    for i, tool in enumerate(tools):
        parameters = tool["function"].get("parameters")
        if parameters is not None:
            param = f"tools[{i}].function.parameters"
            try:
                schema = arguments_schema(parameters)
            except ValueError as error:
                raise ApiError(400, "invalid_value", f"{param!r} {error}", param) from None
            parts.append((param, _checked(GrammarSpec.json_schema, schema, param)))
    spec = _checked(lambda _: tool_grammar(fmt, tools, choice, parallel, text_schema), None, "tools")
    return Constraint(spec, "tools", tuple(parts))


@dataclass(frozen=True)
class ToolPlan:
    """How a request with tools is served (see ``plan_tools``)."""

    constraint: Constraint  # the answer's grammar (calls only, or text and calls with auto)
    tools: list[dict]  # GenerateRequest.tools: rendered by the template, or checked and shown by tool_prompt
    tool_prompt: GenericPrompt | None  # GenerateRequest.tool_prompt: the generic form (no tool format), else None
    format: ToolFormat  # how the answer's calls are parsed (ToolCallParser)


def plan_tools(tools: list[dict], choice: str, parallel: bool | None, limits: Limits,
               text_schema: dict | None = None) -> ToolPlan:
    """tools: [{"type": "function", "function": {"name", "description"?, "parameters"?}}] (names checked);
    choice: auto | required | a function's name (not none: no tools are served then); parallel: the
    request's ``parallel_tool_calls`` (None: not said). ``text_schema``: the request's response format as a
    JSON schema: with ``auto`` a text answer must follow it; a forced call ignores it, as OpenAI does.
    Raises ApiError (400) for repeated names, a schema that is refused, and ``auto`` on a template without
    a tool format when the server refuses it there (GENERIC_TOOL_CHOICE_AUTO=false)."""
    seen: set[str] = set()  # (a set: 10,000 tools are checked in linear time)
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            raise ApiError(400, "invalid_value", f"'tools[{i}].function.name' repeats the name {name!r}",
                           f"tools[{i}].function.name")
        seen.add(name)
    if choice != "auto":
        text_schema = None
    if limits.tool_format is not None:
        return ToolPlan(tool_constraint(limits.tool_format, tools, choice, parallel is not False, text_schema), tools,
                        None, limits.tool_format)
    if choice == "auto" and not limits.generic_tool_choice_auto:
        raise ApiError(400, "unsupported_value", "this model's chat template has no tool-call format, and this "
                       "server does not serve tool_choice auto in the generic form (GENERIC_TOOL_CHOICE_AUTO=false); "
                       "send tool_choice required or a named function (the call is decoded under the tool's "
                       "schema), or none", "tool_choice")
    # The generic form: one call per answer unless the request allows more in so many words
    # (llm_api.text.tools says why).
    return ToolPlan(tool_constraint(GENERIC, tools, choice, parallel is True, text_schema), tools,
                    generic_tool_prompt(tools, choice), GENERIC)
