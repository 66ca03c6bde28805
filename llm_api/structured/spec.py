"""What a request asks structured output to follow, and what it may cost to compile: no torch, no xgrammar.

Contract
- ``GrammarSpec`` is what a request asks for: a JSON schema, any JSON object, a regex, an EBNF grammar
  or an xgrammar structural tag (free text with tagged JSON sections: tool calls), as text. Specs are
  frozen and hashable; equal specs share one compiled grammar (``llm_api.structured.compiler``). Build
  them with the class methods (``GrammarSpec.json_schema(dict_or_text)`` writes the canonical text).
- ``Constraint`` is a spec together with the request field it came from (named in every error about it)
  and, for a grammar built from several client schemas (tool calls), each schema with its own field. The
  request formats build it; the service compiles its spec into ``SamplingParams.grammar``.
- Compile cost is bounded before compiling (``GrammarLimits``, ``check_limits``; the compiler checks
  every spec): the source may hold at most ``max_source_chars`` characters, and the string-length
  bounds (``minLength``/``maxLength``, one count per distinct pair) and repetition bounds (``{m,n}`` in
  a regex, a schema ``pattern`` or an EBNF grammar) may add up to at most ``max_bound_total``. Each unit
  costs ~20 ms of compile on one CPU core (measured: ``maxLength`` 64: 1.4 s, 128: 2.9 s, 300: 4.4 s;
  ten fields with bounds 10..19: 2.2 s), so the default 256 keeps one spec to a few seconds. Brackets
  may nest at most ``max_depth`` (64) levels: compile time grows faster than the depth (measured, one
  core: objects nested 100 deep, 200 JSON levels: 1.2 s; 200 deep: 2.6 s; 400 deep: 16 s, in 22 KB), and
  no real schema comes near 64. A spec over a limit raises ``GrammarError`` naming the limit, at once.
- ``GrammarError`` is every structured-output error (a malformed spec, one over a limit, one the library
  rejects); its message is one line, any echoed input cut to ~200 characters (``one_line``).

Importing this module is free (the request formats use it while parsing).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["GRAMMAR_KINDS", "JSON_MAX_WHITESPACE", "GrammarError", "GrammarSpec", "Constraint", "GrammarLimits",
           "check_limits", "one_line", "kind_name"]

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")
_MAX_ECHO_CHARS = 200
JSON_MAX_WHITESPACE = 32  # whitespace characters in a row a JSON grammar allows (see GrammarCompiler)


class GrammarError(ValueError):
    """A grammar spec the library rejects; the message is one line naming the problem."""


def one_line(text: str, limit: int = _MAX_ECHO_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class GrammarSpec:
    """kind: json_object | json_schema | regex | ebnf | structural_tag; source: the schema as canonical
    JSON text, the regex (matched in full), the EBNF (root rule ``root``), or the structural tag as
    canonical JSON text (xgrammar's ``{"type": "structural_tag", "format": ...}``); "" for json_object."""

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, "
                               f"got {one_line(repr(self.kind), 40)}")
        if not isinstance(self.source, str):
            raise GrammarError(f"grammar source must be a string, got {type(self.source).__name__}")
        if self.kind == "json_object" and self.source:
            raise GrammarError("a json_object grammar takes no source")
        if self.kind != "json_object" and not self.source:
            raise GrammarError(f"a {self.kind} grammar needs a non-empty source")

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> "GrammarSpec":
        """From a schema object or its JSON text, written canonically (compact, keys kept in their
        order: property order is the order the output follows)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"invalid JSON schema: not valid JSON: {one_line(str(e))}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"invalid JSON schema: must be an object or a boolean, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")))

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, grammar: str) -> "GrammarSpec":
        return cls("ebnf", grammar)

    @classmethod
    def structural_tag(cls, tag: dict) -> "GrammarSpec":
        """From xgrammar's structural tag object (``{"type": "structural_tag", "format": {...}}``)."""
        if not isinstance(tag, dict):
            raise GrammarError(f"a structural tag must be an object, got {type(tag).__name__}")
        return cls("structural_tag", json.dumps(tag, ensure_ascii=False, separators=(",", ":")))


@dataclass(frozen=True)
class Constraint:
    """Structured output a request asks for: the grammar, the request field it came from (named in every
    error about it), and for a grammar built from several client schemas (tool calls) each schema with
    its own field, so that an error names the one at fault."""

    spec: GrammarSpec
    param: str
    parts: tuple[tuple[str, GrammarSpec], ...] = ()


@dataclass(frozen=True)
class GrammarLimits:
    """What one spec may cost to compile (see the module docstring); None: no limit."""

    max_source_chars: int | None = 65536
    max_bound_total: int | None = 256
    max_depth: int | None = 64


# {m}, {m,} or {m,n} in a regex or an EBNF grammar (a literal "{3}" inside quotes counts too: conservative).
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _repetition_total(text: str) -> int:
    total = 0
    for match in _QUANTIFIER.finditer(text):
        low, high = match.group(1), match.group(2)
        # (digits of a huge literal are not converted: anything over 9 digits is over any limit anyway)
        total += min(max(int(low[:10]), int(high[:10]) if high else 0), 10**10)
    return total


def _schema_bound_total(value: Any) -> int:
    """String-length bounds (one count per distinct min/max pair) + repetition bounds of the patterns and
    grammars anywhere in a JSON schema or structural tag. Iterative: the value may be deeply nested."""
    length_pairs: set[tuple[int, int]] = set()
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            low, high = item.get("minLength"), item.get("maxLength")
            bounds = [b for b in (low, high) if isinstance(b, int) and not isinstance(b, bool)]
            if bounds:
                length_pairs.add((low if low in bounds else 0, high if high in bounds else 0))
            for key in ("pattern", "grammar"):
                if isinstance(item.get(key), str):
                    total += _repetition_total(item[key])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total + sum(min(max(abs(low), abs(high)), 10**10) for low, high in length_pairs)


def _nesting_depth(text: str, quoted_strings: bool) -> int:
    """How deep brackets (``{[(``) nest in ``text``, outside escapes and, with ``quoted_strings`` (JSON, EBNF),
    outside double-quoted strings. Counted on the text, so it also works where ``json.loads`` would recurse
    too deep; brackets in a regex character class count too (conservative)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"' and quoted_strings:
            in_string = not in_string
        elif in_string:
            continue
        elif char in "{[(":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "}])":
            depth -= 1
    return deepest


def check_limits(spec: GrammarSpec, limits: GrammarLimits = GrammarLimits()) -> None:
    """Raise ``GrammarError`` when ``spec`` is over a compile-cost limit (cheap: one pass over the source)."""
    if limits.max_source_chars is not None and len(spec.source) > limits.max_source_chars:
        raise GrammarError(f"the {kind_name(spec.kind)} has {len(spec.source)} characters; the limit is "
                           f"{limits.max_source_chars}")
    if limits.max_depth is not None and spec.kind != "json_object":
        depth = _nesting_depth(spec.source, quoted_strings=spec.kind != "regex")
        if depth > limits.max_depth:
            raise GrammarError(f"the {kind_name(spec.kind)} nests {depth} levels deep; the limit is "
                               f"{limits.max_depth} (compile time grows faster than the depth)")
    if limits.max_bound_total is None or spec.kind == "json_object":
        return
    if spec.kind in ("json_schema", "structural_tag"):
        try:
            total = _schema_bound_total(json.loads(spec.source))
        except (ValueError, RecursionError):
            return  # not JSON: compile() names that problem
    else:
        total = _repetition_total(spec.source)
    if total > limits.max_bound_total:
        raise GrammarError(f"the {kind_name(spec.kind)}'s length and repetition bounds (maxLength, minLength, "
                           f"{{m,n}}) add up to {total if total < 10**10 else 'more than 10**10'}; the limit is "
                           f"{limits.max_bound_total} (each unit costs ~20 ms of grammar compile)")


def kind_name(kind: str) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object grammar", "ebnf": "EBNF grammar",
            "structural_tag": "structural tag"}.get(kind, kind)
