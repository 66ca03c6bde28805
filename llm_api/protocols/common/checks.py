"""The request checks every API that takes the field applies alike, written once.

* ``tool_choice_keyword``: a ``tool_choice`` keyword (``none``, ``auto``, ``required``) or the API's named
  choice (chat: ``{"type": "function", "function": {"name"}}``; Responses: ``{"type": "function", "name"}``).
* ``call_arguments``: an earlier tool call's ``arguments`` (JSON text) -> the object, or 400 naming the field.
* ``refuse_ignore_eos``: ``ignore_eos`` with a constraint is refused (a grammar decides where the answer
  ends), naming ``ignore_eos``, with the API's code for a bad value (native ``invalid_parameter``, OpenAI
  ``invalid_value``).
* ``check_priority``: a request's ``priority`` (vLLM's field: an integer, lower first), taken only under
  SCHEDULING_POLICY=priority; otherwise anything but 0 is refused naming ``priority`` (as vLLM refuses it
  without its priority policy), so a client never believes it was served ahead when it was not.
* ``apply_output``: a response format's constraint, or the plan of the tools (``llm_api.service.constraints.
  plan_tools``), set on the request; then the ``ignore_eos`` refusal; then, for a model with a reasoning
  parser, the constraint applied to the answer after the think block (``answer_only``).
"""

from __future__ import annotations

from typing import Any

from llm_api.errors import ApiError, echo
from llm_api.model.setting_values import PRIORITY_MAX, PRIORITY_MIN
from llm_api.protocols.common.validation import decode_json
from llm_api.service.constraints import ToolPlan, ignore_eos_conflict
from llm_api.service.request import GenerateRequest, Limits
from llm_api.structured.spec import Constraint
from llm_api.text.reasoning import answer_only
from llm_api.text.tools import ToolFormat

TOOL_CHOICES = ("none", "auto", "required")
PRIORITY_RANGE = (PRIORITY_MIN, PRIORITY_MAX)  # (an int32, as vLLM's field is on the wire; plenty of levels)


def check_priority(value: int | None, limits: Limits, code: str = "unsupported_value") -> int:
    """The request's priority (not given: 0); 400 ``code`` naming ``priority`` for another value when the
    server schedules in arrival order."""
    if value is None or value == 0:
        return 0
    if not limits.priority_scheduling:
        raise ApiError(400, code, "'priority' is not served: this server schedules requests in arrival order "
                       "(SCHEDULING_POLICY=fcfs); send 0 or leave it out", "priority")
    return value


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


def call_arguments(text: str, param: str) -> dict:
    """An earlier call's arguments (the JSON text of an object, field ``param``) -> the object (what chat
    templates render), or 400 ``invalid_value`` naming ``param``."""
    try:
        value = decode_json(text.encode("utf-8"), what=repr(param), code="invalid_value")
    except ApiError as error:
        raise ApiError(400, error.code, error.message, param) from None
    if not isinstance(value, dict):
        raise ApiError(400, "invalid_value", f"{param!r} must be a JSON object (as text)", param)
    return value


def refuse_ignore_eos(ignore_eos: bool, constraint_field: str | None, code: str) -> None:
    """400 naming ``ignore_eos`` when it is set beside a constraint (``constraint_field``: the constraint's
    top-level field; None: the request has no constraint)."""
    if ignore_eos and constraint_field is not None:
        raise ignore_eos_conflict(constraint_field, code)


def apply_output(request: GenerateRequest, constraint: Constraint | None, plan: ToolPlan | None, *, ignore_eos: bool,
                 format_field: str, limits: Limits) -> ToolFormat | None:
    """Set the request's constraint from the response format (``constraint``) or the tools' ``plan`` (its
    grammar, the tools the prompt renders, the generic tools block), refuse ``ignore_eos`` beside either
    (``format_field`` names the response format's field), and under a reasoning parser apply the constraint
    to the answer only. Returns the format the answer's calls are parsed in (None: no tools)."""
    tool_format = None
    if plan is not None:
        request.constraint, request.tools, request.tool_prompt = plan.constraint, plan.tools, plan.tool_prompt
        tool_format = plan.format
    else:
        request.constraint = constraint
    field = None if request.constraint is None else "tools" if plan is not None else format_field
    refuse_ignore_eos(ignore_eos, field, "invalid_value")
    if limits.reasoning_format is not None and request.constraint is not None:
        # the think block stays free text; the format or the calls apply to the answer after it
        request.constraint = answer_only(limits.reasoning_format, request.constraint)
    return tool_format
