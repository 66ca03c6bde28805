"""Token logprobs as responses show them: token ids -> text and bytes, and the three renderings.

The engine reports a ``TokenLogprob`` (ids and numbers) per generated token. ``TokenTexts(tokenizer)``
turns one into a ``LogprobItem`` whose tokens carry their own text and exact bytes: for byte-level BPE
tokenizers (GPT-2, Llama 3, Qwen, SmolLM) the bytes come from the token's byte-level string (so a token
holding half of a UTF-8 character keeps its real bytes, and its text shows U+FFFD); for SentencePiece
byte-fallback tokens (``<0x0A>``) the byte itself; otherwise the UTF-8 of the decoded token. Lookups
are cached per id.

Renderings (``-inf``, the logprob of a token that top-k / top-p removed, is written as -9999.0, as vLLM
does: JSON has no infinity):

* ``openai_chat_logprobs``: OpenAI chat's ``{"content": [{token, logprob, bytes, top_logprobs}],
  "refusal": None}``;
* ``openai_completion_logprobs``: the legacy completions' ``{tokens, token_logprobs, top_logprobs,
  text_offset}`` (each ``top_logprobs`` entry also holds the sampled token, as OpenAI documents: up to
  ``logprobs`` + 1 entries; an echoed prompt's first token has ``null`` in both, as OpenAI and vLLM send it);
* ``native_logprobs``: ``[{token, token_id, logprob, top_logprobs: [{token, token_id, logprob}]}]``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from llm_api.engine.request import TokenLogprob
from llm_api.model.tokenizer import BYTE_LEVEL_ALPHABET

NEG_INF_LOGPROB = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class TokenText:
    token_id: int
    text: str
    bytes: bytes


@dataclass(frozen=True)
class LogprobItem:
    token: TokenText
    logprob: float | None  # None: the prompt's first token, which nothing before it scores (echo)
    top: tuple[tuple[TokenText, float], ...] = ()


class TokenTexts:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, TokenText] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_decoder = None
        if decoder is not None and type(decoder).__name__ == "ByteLevel":
            self._byte_decoder = BYTE_LEVEL_ALPHABET

    def __call__(self, token_id: int) -> TokenText:
        found = self._cache.get(token_id)
        if found is None:
            raw = self._bytes_of(token_id)
            found = self._cache[token_id] = TokenText(token_id, raw.decode("utf-8", errors="replace"), raw)
        return found

    def item(self, logprob: TokenLogprob) -> LogprobItem:
        return LogprobItem(self(logprob.token_id), logprob.logprob, tuple((self(i), v) for i, v in logprob.top))

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8", errors="replace")


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else NEG_INF_LOGPROB


def openai_chat_logprobs(items: list[LogprobItem]) -> dict:
    def entry(token: TokenText, logprob: float | None) -> dict:
        return {"token": token.text, "logprob": _finite(logprob), "bytes": list(token.bytes)}

    return {"content": [{**entry(item.token, item.logprob), "top_logprobs": [entry(t, v) for t, v in item.top]}
                        for item in items], "refusal": None}


def openai_completion_logprobs(items: list[LogprobItem], text_offset: int) -> dict:
    """``text_offset``: characters of the answer before the first of these tokens."""
    offsets = []
    for item in items:
        offsets.append(text_offset)
        text_offset += len(item.token.text)
    top: list[dict | None] = []
    for item in items:
        if item.logprob is None:  # (the prompt's first token: OpenAI's null)
            top.append(None)
            continue
        alternatives = {t.text: _finite(v) for t, v in item.top}
        alternatives.setdefault(item.token.text, _finite(item.logprob))
        top.append(alternatives)
    return {"tokens": [item.token.text for item in items], "token_logprobs": [_finite(i.logprob) for i in items],
            "top_logprobs": top, "text_offset": offsets}


def native_logprobs(items: list[LogprobItem]) -> list[dict]:
    def entry(token: TokenText, logprob: float | None) -> dict:
        return {"token": token.text, "token_id": token.token_id, "logprob": _finite(logprob)}

    return [{**entry(item.token, item.logprob), "top_logprobs": [entry(t, v) for t, v in item.top]}
            for item in items]
