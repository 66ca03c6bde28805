"""The field rules every request format shares, as pydantic types, and pydantic's errors as ``ApiError``.

Request bodies are declared as pydantic models (each API's ``schema`` in ``llm_api.protocols``); the
rules a field obeys are written once here as annotated types:

* ``Number(low, high)`` / ``Integer(low, high)``: a JSON number, or a string holding one (form fields and
  gRPC's input map carry strings); never a boolean; finite; inside the range, whose bounds the message
  states (``'top_p' must be in (0, 1], got 1.5``). ``Flag``: true/false (or "true"/"1"/"yes"/"false"/
  "0"/"no" as text). ``Text``: a string without NUL characters or lone surrogates (the tokenizer cannot
  take them). ``StopStrings(n)``: one string or up to ``n`` non-empty ones of at most 256 characters.
* ``LogitBias(text_ok)``: an object mapping token ids (decimal strings, as JSON keys must be) to biases
  in [-100, 100], at most ``MAX_LOGIT_BIAS`` entries, ids below the model's vocabulary size (read from
  the validation context's ``limits``), as ``((token_id, bias), ...)``.
* ``nonempty_list``: a before-validator for an array that must hold something (a body's ``messages``).
* ``from_form_json``: a before-validator that decodes a form field's JSON text (messages, stop lists,
  embeddings arrive as text in form posts and gRPC's input map).

``first_error`` and ``message_of`` turn a pydantic ``ValidationError`` into what each format's
``ApiError`` reports: the field path (``messages[0].role``), a message naming the field, and the kind of
error (unknown field, missing, wrong type, bad value) from which the format picks its code. Field names
and values from the request reach a message only through ``errors.echo``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, ValidationError, ValidationInfo
from pydantic_core import ErrorDetails, PydanticCustomError

from llm_api.errors import echo
from llm_api.protocols.common.validation import decode_json

MAX_STOP_STRING_CHARS = 256
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit)
MAX_LOGIT_BIAS_VALUE = 100.0
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes"), ("false", "0", "no")


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {list: "an array", dict: "an object", str: "a string", type(None): "null"}.get(type(value),
                                                                                         type(value).__name__)


def fail(kind: str, message: str) -> PydanticCustomError:
    """A validation error of ``kind`` (formats map some kinds to their own codes) with this message."""
    return _fail(kind, message)


def _fail(kind: str, message: str) -> PydanticCustomError:
    # Braces in a message would be read as template fields by pydantic: keep them literal.
    return PydanticCustomError(kind, message.replace("{", "{{").replace("}", "}}"))


# ---------------------------------------------------------------------------------------------------
# scalars


def _to_number(value: Any, text_ok: bool = True) -> float:
    if isinstance(value, str) and text_ok:
        try:
            value = float(value.strip())
        except ValueError:
            raise _fail("number_type", f"must be a number, got {echo(value)}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail("number_type", f"must be a number, not {_json_type(value)}")
    try:
        value = float(value)
    except OverflowError:  # an integer literal beyond float's range
        raise _fail("number_range", "must be a finite number") from None
    if not math.isfinite(value):
        raise _fail("number_range", "must be a finite number")
    return value


def _to_integer(value: Any, text_ok: bool = True) -> int:
    if isinstance(value, str) and text_ok:
        try:
            value = int(value.strip())
        except ValueError:  # (also: more digits than Python converts)
            raise _fail("integer_type", f"must be an integer, got {echo(value)}") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail("integer_type", f"must be an integer, not {_json_type(value)}")
    return value


def _to_flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS:
        return True
    if isinstance(value, str) and value.strip().lower() in FALSE_WORDS:
        return False
    raise _fail("bool_type", f"must be true or false, got {echo(value)}")


def _number_in(low: float, high: float, low_open: bool):
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"

    def check(value: float) -> float:
        if (value <= low if low_open else value < low) or value > high:
            raise _fail("number_range", f"must be in {interval}, got {value:g}")
        return value

    return check


def _integer_in(low: int, high: int):
    def check(value: int) -> int:
        if not low <= value <= high:
            shown = value if abs(value) < 10**20 else f"{str(value)[:20]}..."
            raise _fail("integer_range", f"must be between {low} and {high}, got {shown}")
        return value

    return check


def Number(low: float, high: float, low_open: bool = False, text_ok: bool = True):  # noqa: N802 (a type factory)
    """A finite number in the range; ``text_ok``: also a string holding one (form fields, gRPC)."""
    return Annotated[float, BeforeValidator(lambda v: _to_number(v, text_ok)),
                     AfterValidator(_number_in(low, high, low_open))]


def Integer(low: int, high: int, text_ok: bool = True):  # noqa: N802
    return Annotated[int, BeforeValidator(lambda v: _to_integer(v, text_ok)), AfterValidator(_integer_in(low, high))]


def _to_strict_flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail("bool_type", f"must be a boolean, not {_json_type(value)}")
    return value


Flag = Annotated[bool, BeforeValidator(_to_flag)]
StrictFlag = Annotated[bool, BeforeValidator(_to_strict_flag)]  # JSON true/false only (the OpenAI format)
WholeNumber = Annotated[int, BeforeValidator(_to_integer)]  # any integer; the caller checks its range
StrictWholeNumber = Annotated[int, BeforeValidator(lambda v: _to_integer(v, text_ok=False))]


def check_text(value: str) -> str:
    if "\x00" in value:
        raise _fail("text_value", "contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _fail("text_value", "contains a lone surrogate (not valid Unicode)") from None
    return value


def _strict_str(value: Any) -> Any:
    if not isinstance(value, str):
        raise _fail("string_type", f"must be a string, not {_json_type(value)}")
    return value


Text = Annotated[str, BeforeValidator(_strict_str), AfterValidator(check_text)]


def _nonempty(value: str) -> str:
    if not value:
        raise _fail("text_value", "must not be empty")
    return value


NonEmptyText = Annotated[Text, AfterValidator(_nonempty)]


def nonempty_list(value: Any) -> Any:
    """A before-validator: the value must be a non-empty JSON array (a body's ``messages``)."""
    if not isinstance(value, list) or not value:
        raise ValueError("must be a non-empty array")
    return value


def StopStrings(max_count: int):  # noqa: N802
    def check(value: Any) -> tuple[str, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise _fail("stop_type", "must be a string or an array of strings")
        if len(items) > max_count:
            raise _fail("stop_value", f"has {len(items)} strings; at most {max_count} are allowed")
        for item in items:
            check_text(item)
            if not 0 < len(item) <= MAX_STOP_STRING_CHARS:
                raise _fail("stop_value", f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters")
        return tuple(items)

    return Annotated[tuple[str, ...], BeforeValidator(check)]


def LogitBias(text_ok: bool = True):  # noqa: N802
    """``{"<token id>": bias}`` -> ``((token_id, bias), ...)`` in the order given."""

    def check(value: Any) -> tuple[tuple[int, float], ...]:
        if not isinstance(value, dict):
            raise _fail("logit_bias_type", f"must be an object mapping token ids to biases, not {_json_type(value)}")
        if len(value) > MAX_LOGIT_BIAS:
            raise _fail("logit_bias_value", f"has {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        items = []
        for key, bias in value.items():
            # Canonical decimal only, so two keys can never name the same id ("1" and "01").
            canonical = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12
            if not (canonical and (key == "0" or key[0] != "0")):
                raise _fail("logit_bias_value", f"keys must be token ids (decimal integers), got {echo(key)}")
            try:
                number = _to_number(bias, text_ok)
            except PydanticCustomError:
                raise _fail("logit_bias_value", f"the bias of token {key} must be a number") from None
            if not -MAX_LOGIT_BIAS_VALUE <= number <= MAX_LOGIT_BIAS_VALUE:
                raise _fail("logit_bias_value", f"the bias of token {key} must be in [-100, 100], got {number:g}")
            items.append((int(key), number))
        return tuple(items)

    def within_vocabulary(value: tuple[tuple[int, float], ...], info: ValidationInfo):
        limits = (info.context or {}).get("limits")
        vocab_size = getattr(limits, "vocab_size", None)
        for token_id, _ in value:
            if vocab_size is not None and token_id >= vocab_size:
                raise _fail("logit_bias_value", f"token id {token_id} is outside the vocabulary (0 to {vocab_size - 1})")
        return value

    return Annotated[tuple[tuple[int, float], ...], BeforeValidator(check), AfterValidator(within_vocabulary)]


def from_form_json(value: Any) -> Any:
    """Form fields carry structured values as JSON text; anything else passes through."""
    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        return decode_json(value.encode("utf-8"), what="the field's JSON text", code="invalid_parameter")
    return value


# ---------------------------------------------------------------------------------------------------
# errors


def field_path(loc: tuple) -> str:
    """pydantic's location -> ``messages[0].content`` (keys from the request echoed safely)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and len(part) <= 64:
            path += f".{part}" if path else part
        elif isinstance(part, str) and part.startswith("function-"):
            continue  # pydantic's name for a validator step, not a field
        else:
            path += f"[{echo(part)}]"
    return path


def first_error(error: ValidationError) -> ErrorDetails:
    """The error to report: an unknown top-level field first (as the formats checked before pydantic)."""
    errors = error.errors(include_url=False, include_input=False)
    extras = [e for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1]
    return (extras or errors)[0]


def message_of(error: ErrorDetails) -> str:
    path = field_path(tuple(error["loc"]))
    msg = error["msg"]
    if error["type"] == "missing":
        msg = "is required"
    elif error["type"] in ("literal_error", "enum"):
        msg = "must be " + msg.removeprefix("Input should be ")
    elif error["type"] in ("list_type", "dict_type", "model_type", "model_attributes_type"):
        msg = "must be " + {"list_type": "an array", "dict_type": "an object"}.get(error["type"], "an object")
    elif error["type"] in ("too_short", "too_long"):
        msg = msg.replace("List should", "must").replace("String should", "must")
    elif error["type"] == "extra_forbidden":
        msg = "is not a known field"
    elif error["type"].startswith(("value_error", "assertion_error")):
        msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    return f"{path!r} {msg}" if path else msg


def is_type_error(error: ErrorDetails) -> bool:
    return error["type"].endswith(("_type", "_parsing"))


def unknown_fields(error: ValidationError) -> list[str]:
    return [str(e["loc"][0]) for e in error.errors(include_url=False, include_input=False)
            if e["type"] == "extra_forbidden" and len(e["loc"]) == 1]
