"""The tokenizer routes' bodies in vLLM's shapes: ``POST /tokenize`` and ``POST /detokenize`` -> what the
service tokenizes (``TokenizeRequest``) or the ids it detokenizes (schema: ``schema``; answers: ``encoder``).

* ``parse_tokenize(body, model_name)`` -> ``TokenizeRequest``: ``{"prompt": str}`` (tokenized as is,
  ``add_special_tokens`` default true: the BOS a completion would get) or ``{"messages": [...]}`` (the
  chat template with the generation prompt, contents kept as data exactly as for a chat call;
  ``add_special_tokens`` may only be false there, vLLM's default, since the template writes its own),
  plus an optional ``model`` that must name the served model. The answer (``tokenize_answer``) is
  ``{"tokens": [...], "count": n, "max_model_len": m}``.
* ``parse_detokenize(body, model_name, vocab_size, max_tokens)`` -> token ids: ``{"tokens": [ints]}``,
  each in ``[0, vocab_size)``, at most ``max_tokens`` of them. The answer (``detokenize_answer``) is
  ``{"prompt": text}``. The ids are checked in pydantic-core and C builtins, never by a Python loop per
  id: a body of a million ids (what max_request_size lets in) costs tens of milliseconds, not a second
  of held GIL (the edges parse a large body off the event loop: ``llm_api.service.answer.parse_large``).

* ``tokenizer_info_answer(tokenizer, max_model_len)``: ``GET /tokenizer_info`` as vLLM serves it (what
  lm-eval's ``tokenizer_backend=remote`` reads): the tokenizer's class, its special tokens (text, or null),
  its chat template and ``model_max_length`` (the server's max model length, not the tokenizer's own).

Errors are ``ApiError``s, rendered in the OpenAI shape by the edge (as vLLM does for these routes).
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import ValidationError

from llm_api.errors import ApiError, model_not_found
from llm_api.protocols.common.openai import api_error
from llm_api.protocols.common.validation import decode_json
from llm_api.protocols.tokenize.schema import DetokenizeBody, TokenizeBody
from llm_api.service.request import ModelNames, TokenizeRequest, adapter_of, names_of

Body = TypeVar("Body", TokenizeBody, DetokenizeBody)


def parse_tokenize(body: bytes | bytearray, model_name: ModelNames) -> TokenizeRequest:
    call = _validated(TokenizeBody, body, model_name)
    if (call.prompt is None) == (call.messages is None):
        raise ApiError(400, "invalid_value", "give exactly one of 'prompt' or 'messages'", "prompt")
    if call.messages is not None:
        if call.add_special_tokens:
            raise ApiError(400, "unsupported_parameter", "'add_special_tokens' must be false with 'messages' (the "
                           "chat template writes the special tokens)", "add_special_tokens")
        return TokenizeRequest(None, [m.to_turn() for m in call.messages], False)
    return TokenizeRequest(call.prompt, None, True if call.add_special_tokens is None else call.add_special_tokens)


def parse_detokenize(body: bytes | bytearray, model_name: ModelNames, vocab_size: int, max_tokens: int) -> list[int]:
    call = _validated(DetokenizeBody, body, model_name)
    token_ids = call.tokens
    if len(token_ids) > max_tokens:
        raise ApiError(400, "invalid_value", f"'tokens' may hold at most {max_tokens} ids", "tokens")
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        i = next(i for i, token in enumerate(token_ids) if not 0 <= token < vocab_size)
        raise ApiError(400, "invalid_value", f"tokens[{i}] is not a token id of this model (0 to "
                       f"{vocab_size - 1})", "tokens")
    return token_ids


def _validated(schema: type[Body], body: bytes | bytearray, model_name: ModelNames) -> Body:
    """The body as ``schema`` (400 for JSON that is not an object or does not fit it; 404 for a ``model``
    other than this one: optional here, as in vLLM)."""
    data = decode_json(body)
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_json", "the body must be a JSON object")
    try:
        call = schema.model_validate(data)
    except ValidationError as error:
        raise api_error(error) from None
    if call.model is not None and adapter_of(call.model, model_name) is not None:
        raise model_not_found(call.model, names_of(model_name))
    return call
