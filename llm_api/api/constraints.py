"""Structured-output fields of every request format -> ``Constraint`` (a grammar spec and its field).

The request formats call these with a field's validated value: a JSON schema (``response_format``'s
``json_schema.schema``, the native ``json_schema``), ``json_object``, a regex, an EBNF grammar, or a
request's tools (``tools`` / ``tool_choice``, see ``llm_api.api.tools``). Each builds the
``GrammarSpec`` and checks it against the compile-cost limits (``llm_api.engine.grammar.check_limits``:
source size, string-length and repetition bounds) at once, so an over-limit grammar costs a 400 and no
compile. What the grammar library itself rejects is found when the service compiles the spec (off the
event loop), and reported the same way: ``ApiError(400, "invalid_grammar", ...)`` with ``param`` naming
the field (``response_format``, ``json_schema``, ``regex``, ``grammar``, ``tools[i].function.parameters``).

``plan_tools(tools, choice, parallel, limits)`` is everything a request's tools decide, for any route that
takes them (chat completions; the Responses API): the ``ToolPlan`` with the grammar, the tools the prompt
carries (``GenerateRequest.tools``), the generic tools block for a template without a tool format
(``GenerateRequest.tool_prompt``) and the format the answer's calls are parsed in. On such a template
``required`` and a named function are served in the generic form (``llm_api.api.tools.GENERIC``) and
``auto`` is refused, naming ``tool_choice``, and one call is made per answer (see ``llm_api.api.tools``
for why).

``ignore_eos_conflict(field, code)`` is the one refusal of ``ignore_eos`` together with a constraint, on
every route that takes both (native, chat completions, the Responses API): a grammar
decides where the answer ends, so "run past the end" has no meaning there.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_api.api.errors import ApiError
from llm_api.api.request import Constraint, Limits
from llm_api.api.tools import GENERIC, ToolFormat, arguments_schema, generic_tool_prompt, tool_grammar
from llm_api.engine.grammar import GrammarError, GrammarSpec, check_limits


def grammar_refusal(param: str, error: GrammarError | str) -> ApiError:
    return ApiError(400, "invalid_grammar", f"{param!r}: {error}", param)


def ignore_eos_conflict(field: str, code: str) -> ApiError:
    """400 naming ``ignore_eos``: ``field`` (the constraint's top-level field) asked for a grammar; ``code`` is
    the route's code for a bad value (native ``invalid_parameter``, OpenAI ``invalid_value``)."""
    return ApiError(400, code, f"'ignore_eos' cannot be combined with {field!r}: the answer ends where its "
                    "grammar ends", "ignore_eos")


def _checked(spec_of, value, param: str) -> GrammarSpec:
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


def tool_constraint(fmt: ToolFormat, tools: list[dict], choice: str, parallel: bool) -> Constraint:
    """tools: [{"type": "function", "function": {"name", "parameters"?...}}]; choice: auto | required | a
    function's name. Each tool's parameters schema is a part, so a schema the library rejects is named (and
    one that allows arguments that are not an object is refused here, naming it)."""
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
    spec = _checked(lambda _: tool_grammar(fmt, tools, choice, parallel), None, "tools")
    return Constraint(spec, "tools", tuple(parts))


@dataclass(frozen=True)
class ToolPlan:
    """How a request with tools is served (see ``plan_tools``)."""

    constraint: Constraint  # the answer's grammar (calls only, or text and calls with auto)
    tools: list[dict]  # GenerateRequest.tools: rendered by the template, or checked and shown by tool_prompt
    tool_prompt: str | None  # GenerateRequest.tool_prompt: the generic tools block (no tool format), else None
    format: ToolFormat  # how the answer's calls are parsed (ToolCallParser)


def plan_tools(tools: list[dict], choice: str, parallel: bool, limits: Limits) -> ToolPlan:
    """tools: [{"type": "function", "function": {"name", "description"?, "parameters"?}}] (names checked);
    choice: auto | required | a function's name (not none: no tools are served then); parallel: more than
    one call allowed. Raises ApiError (400) for repeated names, a schema that is refused, and ``auto`` on a
    template without a tool format."""
    seen: set[str] = set()  # (a set: 10,000 tools are checked in linear time)
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            raise ApiError(400, "invalid_value", f"'tools[{i}].function.name' repeats the name {name!r}",
                           f"tools[{i}].function.name")
        seen.add(name)
    if limits.tool_format is not None:
        return ToolPlan(tool_constraint(limits.tool_format, tools, choice, parallel), tools, None, limits.tool_format)
    if choice == "auto":
        raise ApiError(400, "unsupported_value", "this model's chat template has no tool-call format, so "
                       "tool_choice auto (the model choosing between text and a call) is not served; send "
                       "tool_choice required or a named function (the call is decoded under the tool's schema), "
                       "or none", "tool_choice")
    # One call per answer in the generic form, whatever ``parallel`` (llm_api.api.tools says why).
    return ToolPlan(tool_constraint(GENERIC, tools, choice, parallel=False), tools, generic_tool_prompt(tools, choice),
                    GENERIC)
