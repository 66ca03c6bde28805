"""The tokenizer routes' bodies (``TokenizeBody``, ``DetokenizeBody``; ``translate`` has the contract)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, StrictInt, TypeAdapter, ValidationError

from llm_api.protocols.chat.schema import ChatMessage
from llm_api.protocols.common.fields import NonEmptyText, StrictFlag, Text, nonempty_list


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    prompt: NonEmptyText | None = None
    messages: Annotated[list[ChatMessage], BeforeValidator(nonempty_list)] | None = None
    add_special_tokens: StrictFlag | None = None


# Integers only (no booleans, floats or numeric strings), checked in Rust.
_TOKEN_IDS = TypeAdapter(list[StrictInt])


def _token_ids(value: Any) -> Any:
    if not isinstance(value, list):
        raise ValueError("must be an array of integer token ids")
    try:
        return _TOKEN_IDS.validate_python(value)
    except ValidationError as error:
        index = error.errors(include_url=False, include_input=False)[0]["loc"][0]
        raise ValueError(f"must be an array of integer token ids; [{index}] is not an integer") from None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    tokens: Annotated[list[int], BeforeValidator(_token_ids)]
