"""ApiError renderings: echoed request data is escaped and cut short, status phrases never carry it, and
the end-of-stream marker never appears in an error's bytes."""

from __future__ import annotations

import json

import pytest

from llm_api.errors import DEFAULT_RETRY_AFTER_S, ApiError, echo, hide_marker, status_phrase

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


@pytest.mark.parametrize("code", ["overloaded", "loading", "shutting_down"])
def test_every_503_says_when_to_retry(code):
    error = ApiError(503, code, "busy")
    assert error.retry_after == DEFAULT_RETRY_AFTER_S
    assert error.headers() == {"Retry-After": str(DEFAULT_RETRY_AFTER_S)}
    assert ApiError(503, code, "busy", retry_after=5).headers() == {"Retry-After": "5"}


@pytest.mark.parametrize("status", [400, 408, 413, 500])
def test_other_errors_add_no_header_unless_told(status):
    assert ApiError(status, "x", "m").headers() == {}
    assert ApiError(status, "x", "m", retry_after=2.7).headers() == {"Retry-After": "2"}  # whole seconds


def test_a_refusal_carries_its_errors_headers_to_the_torchserve_row():
    """Reply.refuse puts an error's headers on its own row of the context, beside its status."""
    from llm_api.service.answer import Refusal
    from llm_api.torchserve.reply import Reply

    class Context:
        request_processor = None
        headers: dict = {}
        statuses: dict = {}

        def get_request_id(self, idx):
            return "id"

        def set_response_status(self, code, phrase, idx):
            self.statuses[idx] = code

        def set_response_content_type(self, idx, content_type):
            pass

        def set_response_header(self, idx, name, value):
            self.headers.setdefault(idx, {})[name] = value

    error = ApiError(503, "overloaded", "busy")
    refusal = Refusal(error.status, error.native_text(), error.headers())
    context = Context()
    Reply(context, 3, async_mode=True).refuse(refusal.status, refusal.body, headers=refusal.headers)
    assert context.statuses == {3: 503} and context.headers[3]["Retry-After"] == "1"
