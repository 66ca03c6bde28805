"""The legacy completions body (``CompletionBody``; ``llm_api.protocols.completions.translate`` has the contract)."""

from __future__ import annotations

from typing import Any

from llm_api.protocols.common.fields import Integer, StrictFlag
from llm_api.protocols.common.openai import OpenAIBody

MAX_COMPLETION_LOGPROBS = 5
# Accepted only at the value that means "off" (what the openai client sends when a caller sets them
# explicitly to their defaults); anything else is refused, naming the parameter.
NEUTRAL_VALUES = {
    "best_of": (1, None), "suffix": (None, ""),
}


class CompletionBody(OpenAIBody):
    prompt: Any  # a string, strings, token ids or lists of token ids: checked by _prompts, which names the item
    logprobs: Integer(0, MAX_COMPLETION_LOGPROBS, text_ok=False) | None = None
    echo: StrictFlag | None = None
    best_of: Any = None
    suffix: Any = None
