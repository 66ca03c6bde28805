"""The tokenizer routes' answers: ``tokenize_answer``, ``detokenize_answer`` and ``tokenizer_info_answer``
(``GET /tokenizer_info`` as vLLM serves it; ``translate`` has the contract)."""

from __future__ import annotations

import json
from typing import Any


def tokenize_answer(token_ids: list[int], max_model_len: int) -> str:
    return json.dumps({"tokens": token_ids, "count": len(token_ids), "max_model_len": max_model_len})


def tokenizer_info_answer(tokenizer: Any, max_model_len: int) -> str:
    def token(name: str) -> str | None:
        value = getattr(tokenizer, name, None)
        return value if isinstance(value, str) else None

    template = getattr(tokenizer, "chat_template", None)
    return json.dumps({
        "tokenizer_class": getattr(tokenizer, "tokenizer_class", None) or type(tokenizer).__name__,
        "bos_token": token("bos_token"), "eos_token": token("eos_token"), "pad_token": token("pad_token"),
        "unk_token": token("unk_token"),
        "add_bos_token": bool(getattr(tokenizer, "add_bos_token", False)),
        "chat_template": template if isinstance(template, str) else None,
        "model_max_length": max_model_len,
    }, ensure_ascii=False)


def detokenize_answer(text: str) -> str:
    return json.dumps({"prompt": text}, ensure_ascii=False)
