"""ApiError renderings: echoed request data is escaped and cut short, status phrases never carry it, and
the end-of-stream marker never appears in an error's bytes."""

from __future__ import annotations

import json

import pytest

from llm_api.api.errors import ApiError, echo, hide_marker, status_phrase

MARKER = "<|endoftext|>"


@pytest.mark.parametrize("value", ["smöllm2", "x\r\nX-Evil: 1", "热" * 10_000, "a" * 6_000_000, "\x00\x1b", "\ud800"])
def test_echo_is_short_ascii_without_line_breaks(value):
    shown = echo(value)
    assert shown.isascii() and "\r" not in shown and "\n" not in shown and len(shown) < 200


@pytest.mark.parametrize("status", [400, 404, 408, 409, 413, 499, 500, 503, 599])
def test_status_phrases_are_fixed_ascii(status):
    phrase = status_phrase(status)
    assert phrase and phrase.isascii() and "\r" not in phrase and "\n" not in phrase


def test_the_marker_never_appears_in_an_error_but_parses_back():
    error = ApiError(400, "invalid_parameter", f"'top_p' must be a number, got {MARKER}")
    text = error.native_text(MARKER)
    assert MARKER not in text and json.loads(text)["message"].endswith(MARKER)
    assert hide_marker('{"k": "no marker"}', MARKER) == '{"k": "no marker"}'


def test_a_param_from_the_request_is_echoed_safely():
    assert ApiError(400, "unknown_parameter", "x", "messages[0].content").param == "messages[0].content"
    assert "\r" not in ApiError(400, "unknown_parameter", "x", "a\r\nb").param
