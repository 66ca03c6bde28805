"""Structured-output fields of every request format -> ``Constraint`` (a grammar spec and its field).

The request formats call these with a field's validated value: a JSON schema (``response_format``'s
``json_schema.schema``, the native ``json_schema``), ``json_object``, a regex, an EBNF grammar, or a
request's tools (``tools`` / ``tool_choice``, see ``llm_api.api.tools``). Each builds the
``GrammarSpec`` and checks it against the compile-cost limits (``llm_api.engine.grammar.check_limits``:
source size, string-length and repetition bounds) at once, so an over-limit grammar costs a 400 and no
compile. What the grammar library itself rejects is found when the service compiles the spec (off the
event loop), and reported the same way: ``ApiError(400, "invalid_grammar", ...)`` with ``param`` naming
the field (``response_format``, ``json_schema``, ``regex``, ``grammar``, ``tools[i].function.parameters``).
"""

from __future__ import annotations

from llm_api.api.errors import ApiError
from llm_api.api.request import Constraint
from llm_api.api.tools import ToolFormat, arguments_schema, tool_grammar
from llm_api.engine.grammar import GrammarError, GrammarSpec, check_limits


def grammar_refusal(param: str, error: GrammarError | str) -> ApiError:
    return ApiError(400, "invalid_grammar", f"{param!r}: {error}", param)


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
