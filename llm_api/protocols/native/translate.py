"""The native request format: a ``/predictions/<model>`` body or gRPC input -> ``GenerateRequest``.

A request reaches the handler as one row of TorchServe's batch: a dict of named fields whose values are
bytes (the handler asks TorchServe not to decode them, so this module owns every parsing decision). A
JSON body arrives as the single field ``body`` (gRPC clients may also send the JSON under ``data``); any
other row is form fields (HTTP form, or gRPC's ``input`` map), whose values are text, coerced to each
field's type (structured fields as JSON text).

A control request ``{"cancel": "<x-request-id>"}`` parses to ``CancelRequest``. Otherwise the request
carries exactly one input (``text``, ``messages`` or ``inputs_embeds``: vectors of the model's hidden
size) and generation parameters, declared by ``NativeBody`` with the shared field rules of
``llm_api.protocols.common.fields``, and at most one structured-output constraint: ``json_schema`` (an object,
or its JSON text in form fields and gRPC), ``regex`` (the whole answer matches it) or ``grammar`` (EBNF, root
rule ``root``), see ``llm_api.service.constraints``. Anything else raises ``ApiError`` (4xx,
``invalid_parameter`` / ``invalid_input`` / ``unknown_field`` / ...) naming the field, for that request alone.

``n`` (choices, up to MAX_NUM_SEQS) above 1 and ``logprobs`` (0..20 alternatives per token) need
``"output": "jsonl"`` (``llm_api.protocols.native.encoder``): the plain text stream has no place for them, so
a request that asks for them without it is refused, naming the field, and existing clients see no
change. ``presence_penalty`` / ``frequency_penalty`` (-2..2) and ``logit_bias`` (``{"<token id>": bias}``,
-100..100) work with either output. What ``n``, ``max_new_tokens``, ``logprobs`` and the prompt may cost
together is bounded by MAX_REQUEST_WORK (``llm_api.service.admission.request_work``): the service refuses a
request over it with 400 ``work_limit_exceeded``, naming these fields.
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import ValidationError

from llm_api.engine.sampling_params import SamplingParams
from llm_api.errors import ApiError, echo
from llm_api.protocols.common.checks import check_priority, refuse_ignore_eos
from llm_api.protocols.common.fields import first_error, message_of, unknown_fields
from llm_api.protocols.common.sampling import to_sampling_params
from llm_api.protocols.common.validation import decode_json
from llm_api.protocols.native.schema import CONSTRAINT_FIELDS, MAX_REQUEST_ID_CHARS, NativeBody
from llm_api.service.constraints import ebnf_constraint, json_schema_constraint, regex_constraint
from llm_api.service.request import DEFAULT_MAX_NEW_TOKENS, INPUT_FIELDS, CancelRequest, GenerateRequest, Limits


def parse_request(row: Mapping[str, Any], limits: Limits, default_stream: bool = True) -> GenerateRequest | CancelRequest:
    """Validate one TorchServe batch row; raise ``ApiError`` naming the first problem found.

    ``default_stream``: whether the answer streams when the request does not say (False for gRPC)."""
    fields = _fields_of(row)
    if "cancel" in fields:
        if set(fields) - {"cancel"}:
            raise ApiError(400, "invalid_request", "a cancel request carries only the field 'cancel'")
        target = fields["cancel"]
        if not isinstance(target, str) or not target:
            raise ApiError(400, "invalid_input", "'cancel' must be a string: the x-request-id of the request to end")
        return CancelRequest(target)
    try:
        body = NativeBody.model_validate(fields, context={"limits": limits})
    except ValidationError as error:
        raise _api_error(error) from None
    given = [k for k in INPUT_FIELDS if getattr(body, k) is not None]
    if not given:
        raise ApiError(400, "missing_input", "the request needs one input: 'text', 'messages' or 'inputs_embeds'")
    if len(given) > 1:
        raise ApiError(400, "too_many_inputs", f"give exactly one input, not {' and '.join(given)}")
    if body.request_id is not None and len(body.request_id) > MAX_REQUEST_ID_CHARS:
        raise ApiError(400, "invalid_parameter", f"'request_id' may have at most {MAX_REQUEST_ID_CHARS} characters")
    if body.output == "text":
        for name, needs_lines in (("n", body.n > 1), ("logprobs", body.logprobs is not None)):
            if needs_lines:
                raise ApiError(400, "invalid_parameter", f"'{name}' needs \"output\": \"jsonl\" (the plain text "
                               "stream has no place for several choices or logprobs)", name)
    return GenerateRequest(
        constraint=_constraint(body),
        text=body.text,
        messages=[m.model_dump(exclude_none=True) for m in body.messages] if body.messages is not None else None,
        inputs_embeds=body.inputs_embeds,
        params=_sampling_params(body, limits),
        stream=default_stream if body.stream is None else body.stream,
        client_request_id=body.request_id,
        timeout_s=body.timeout,
        output=body.output,
        adapter=body.adapter,
        priority=check_priority(body.priority, limits, "invalid_parameter"),
    )


def _constraint(body: NativeBody):
    asked = [name for name in CONSTRAINT_FIELDS if getattr(body, name) is not None]
    if len(asked) > 1:
        raise ApiError(400, "invalid_parameter", f"give at most one of 'json_schema', 'regex' and 'grammar', not "
                       f"{' and '.join(map(repr, asked))}", asked[1])
    refuse_ignore_eos(body.ignore_eos, asked[0] if asked else None, "invalid_parameter")
    if body.json_schema is not None:
        return json_schema_constraint(body.json_schema, "json_schema")
    if body.regex is not None:
        return regex_constraint(body.regex, "regex")
    if body.grammar is not None:
        return ebnf_constraint(body.grammar, "grammar")
    return None


def _sampling_params(body: NativeBody, limits: Limits) -> SamplingParams:
    # Like TGI: asking for a sampling control without do_sample means sampling.
    wants_sampling = any(v is not None for v in (body.temperature, body.top_p, body.top_k))
    return to_sampling_params(
        max_tokens=body.max_new_tokens, default_max_tokens=DEFAULT_MAX_NEW_TOKENS, limits=limits,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, logit_bias=body.logit_bias,
        do_sample=wants_sampling if body.do_sample is None else body.do_sample, seed=body.seed, stop=body.stop,
        ignore_eos=body.ignore_eos, logprobs=body.logprobs, n=body.n)


def _api_error(error: ValidationError) -> ApiError:
    unknown = unknown_fields(error)
    if unknown:
        allowed = ", ".join(NativeBody.model_fields)
        return ApiError(400, "unknown_field", f"unknown field(s) {', '.join(map(echo, unknown[:5]))}; allowed: {allowed}",
                        unknown[0][:64])
    detail = first_error(error)
    field = detail["loc"][0] if detail["loc"] else None
    if detail["type"] == "prompt_too_long":
        code = "prompt_too_long"
    else:
        code = "invalid_input" if field in INPUT_FIELDS or field == "request_id" else "invalid_parameter"
    return ApiError(400, code, message_of(detail), str(field) if field is not None else None)


# ---------------------------------------------------------------------------------------------------
# payload decoding


def _fields_of(row: Mapping[str, Any]) -> dict:
    """The request's fields: a JSON object body, or form fields (values kept as text)."""
    if not isinstance(row, Mapping) or not row:
        raise ApiError(400, "empty_body", "empty request: send a JSON object or form fields")
    body_key = "body" if "body" in row else "data" if ("data" in row and len(row) == 1) else None
    if body_key is not None:
        value = row[body_key]
        if isinstance(value, (bytes, bytearray)):
            value = decode_json(value)
        elif isinstance(value, str):
            value = decode_json(value.encode("utf-8"))
        if not isinstance(value, dict):
            raise ApiError(400, "invalid_json", "the JSON body must be an object")
        return value
    return {str(k): _form_value(k, v) for k, v in row.items()}


def _form_value(name: Any, value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(400, "invalid_encoding", f"field {echo(name)} is not valid UTF-8 (byte {exc.start})") from None
    return value
