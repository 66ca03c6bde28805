"""The body of ``POST v1/embeddings`` in OpenAI's shape, plus ``pooling`` (``translate`` has the contract)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from llm_api.protocols.common.fields import Integer, Text


class EmbeddingsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text
    input: Text | list[Text] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Integer(1, 1 << 20, text_ok=False) | None = None
    user: Text | None = None
    pooling: Literal["mean", "last"] = "mean"  # ours: over the prompt's tokens, or its last token's
