"""Checks every request format shares: JSON bodies decoded strictly, and text that may reach the tokenizer.

``decode_json(raw)`` decodes a body (or a form field carrying JSON) and refuses, with a 400 naming the
problem: an empty body, invalid UTF-8, invalid JSON, duplicate keys (whichever value a parser kept, the
two readers of the body would disagree), NaN/Infinity, integers too long for Python's int conversion
(over 4,300 digits: ``json`` raises a plain ``ValueError`` for them) and nesting deeper than
``MAX_JSON_DEPTH``. ``check_text`` refuses NUL characters and lone surrogates (not valid Unicode; the
tokenizer cannot encode them).
"""

from __future__ import annotations

import json
from typing import Any

from llm_api.errors import ApiError, echo

MAX_JSON_DEPTH = 32
_SCALAR_TYPES = frozenset({str, int, float, bool, type(None)})  # what json.loads makes besides list and dict


def decode_json(raw: bytes | bytearray, what: str = "the body", code: str = "invalid_json") -> Any:
    if not raw or raw.isspace():  # (the same whitespace as strip(), without a copy of the body)
        raise ApiError(400, "empty_body", f"{what} is empty: send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, "invalid_encoding", f"{what} is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    except ApiError:
        raise
    except RecursionError:
        raise ApiError(400, code, f"{what} is nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, code, f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") \
            from None
    except ValueError:  # int() refuses integer literals over sys.get_int_max_str_digits() digits
        raise ApiError(400, code, f"{what} holds a number literal too long to read") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise ApiError(400, code, f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise ApiError(400, "invalid_json", f"duplicate JSON key {echo(key)}")
        seen[key] = value
    return seen


def _no_constant(name: str) -> Any:
    raise ApiError(400, "invalid_json", f"{name} is not a valid JSON number")


def _depth(value: Any) -> int:
    depth, level = 0, [value]
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            return depth
        nxt: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                nxt.extend(item.values())
            elif isinstance(item, list) and not _SCALAR_TYPES.issuperset(map(type, item)):
                # (the types are looked at in C first: an array of a million numbers, a /detokenize
                # body, is walked in ~40 ms instead of ~300 ms of held GIL)
                nxt.extend(x for x in item if isinstance(x, (list, dict)))
        level = nxt
    return depth
