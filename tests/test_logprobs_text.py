"""Token texts for logprobs (exact bytes, even for half a character) and the native JSON-lines output."""

import json

from llm_api.engine.request import FinishReason, TokenLogprob
from llm_api.errors import ApiError
from llm_api.protocols.native.encoder import NativeStream
from llm_api.text.logprobs import BYTE_LEVEL_ALPHABET, LogprobItem, TokenTexts, TokenText

MARKER = "<|endoftext|>"


def test_token_bytes_rebuild_the_text_exactly(embedded_lm_fp32):
    tokenizer = embedded_lm_fp32.tokenizer
    texts = TokenTexts(tokenizer)
    text = "Café au lait 😀 — naïve <|im_end|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [texts(i) for i in ids]
    assert b"".join(p.bytes for p in pieces) == text.encode()
    assert any("\ufffd" in p.text for p in pieces)  # the emoji's bytes are split over tokens
    item = texts.item(TokenLogprob(ids[0], -0.5, ((ids[0], -0.5), (ids[1], -1.5))))
    assert item.token == pieces[0] and item.logprob == -0.5 and [t.token_id for t, _ in item.top] == ids[:2]


def test_the_byte_level_alphabet_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert BYTE_LEVEL_ALPHABET == {char: byte for byte, char in bytes_to_unicode().items()}


def test_native_json_lines():
    tok = TokenText(3, MARKER, MARKER.encode())  # a token whose text is the marker itself
    stream = NativeStream(MARKER, streaming=True, json_lines=True, with_logprobs=True)
    out = stream.delta("Hi", 1, (LogprobItem(tok, -0.25, ((tok, -0.25),)),))
    out += stream.choice_finish(1, FinishReason.STOP, 4) + stream.finish(FinishReason.STOP, 5, 7)
    assert out.endswith("\n" + MARKER) and out.count(MARKER) == 1
    lines = [json.loads(line) for line in out[: -len(MARKER)].splitlines()]
    assert lines[0]["index"] == 1 and lines[0]["text"] == "Hi"
    assert lines[0]["logprobs"][0]["token"] == MARKER and lines[0]["logprobs"][0]["token_id"] == 3
    assert lines[1] == {"index": 1, "finish_reason": "stop", "completion_tokens": 4}
    assert lines[2] == {"usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}
    unary = NativeStream(MARKER, streaming=False, json_lines=True)
    assert unary.delta("a") == "" and unary.choice_finish(0, FinishReason.LENGTH, 1) == ""
    whole = unary.finish(FinishReason.STOP, 1, 1)
    assert [json.loads(line) for line in whole[: -len(MARKER)].splitlines()][0] == {"index": 0, "text": "a"}
    failing = NativeStream(MARKER, streaming=True, json_lines=True)
    failing.delta("a")
    assert json.loads(failing.fail(ApiError(408, "timeout", "late")))["type"] == "timeout"
    text = NativeStream(MARKER, streaming=True)
    assert text.delta("a", 0) == "a" and text.choice_finish(0, FinishReason.STOP, 1) == "" and text.finish() == MARKER


def test_a_unary_answer_over_its_bound_is_refused_not_sent():
    import pytest

    stream = NativeStream(MARKER, streaming=False, json_lines=True, max_unary_bytes=100)
    stream.delta("a" * 60)
    with pytest.raises(ApiError) as err:
        stream.delta("é" * 30)  # 60 bytes of UTF-8 more
    assert err.value.code == "response_too_large" and "stream" in err.value.message
    assert NativeStream(MARKER, streaming=True, max_unary_bytes=100).delta("a" * 1000) == "a" * 1000
