"""One error type for every refused or failed request, rendered per request format.

``ApiError(status, code, message, param)``: ``status`` is the HTTP status (4xx for the client's mistake,
5xx for ours), ``code`` a stable machine-readable name (``invalid_parameter``, ``prompt_too_long``,
``overloaded``, ...), ``message`` one sentence naming the problem, ``param`` the offending field when
there is one. Two renderings:

* native (``/predictions/<model>``, gRPC): ``{"code": <status>, "type": <code>, "message": ...}``;
* OpenAI (``/v1/...``): ``{"error": {"message", "type", "param", "code"}}`` with OpenAI's ``type``
  (``invalid_request_error`` for 4xx, ``server_error`` for 5xx);
* Anthropic (``/v1/messages``): ``{"type": "error", "error": {"type", "message", "code"}}`` with Anthropic's
  ``type`` for the status (``ANTHROPIC_ERROR_TYPES``: what the ``anthropic`` SDK and Claude Code read;
  ``code`` is ours, an extra field its clients ignore).

Whatever a request sent may end up in a message, so every echoed value goes through ``echo()``: shown as
an ASCII-only Python literal (control characters, CR/LF and non-ASCII escaped) and cut to a short length,
so no request can make an error message carry raw bytes, line breaks or megabytes. The status phrase and
headers an edge sends never carry a message (``status_phrase`` is a fixed ASCII text per status).

A 503 (a shared resource is full: the queue, the tokens in flight, the grammar compile pool; or the
server loads or drains) always carries ``retry_after``, whole seconds a client should wait before trying
again (``DEFAULT_RETRY_AFTER_S`` unless the raiser knows better); both edges send it as a ``Retry-After``
header (``headers()``), made from that number alone, never from request data.

Layer: imports nothing of the package; every layer above the engine raises it (the edges, the request formats,
the service, the text handling of ``llm_api.text``), and nothing at or below the engine does
(tests/test_architecture.py).
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Iterable

MAX_ECHO_CHARS = 60
SAFE_PARAM = re.compile(r"[A-Za-z0-9_.\[\]]{1,100}")  # a field path such as messages[0].content
# A full queue or pool frees within about an engine step or a compile: one second is long enough for a
# retry to find room and short enough that a client does not sit idle on a server with capacity.
DEFAULT_RETRY_AFTER_S = 1
# Anthropic's error types by HTTP status (its API reference, "Errors"); any other 4xx is
# invalid_request_error, any other 5xx api_error.
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def echo(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """A request-supplied value, safe to put in a message: ASCII, escaped, at most ~``limit`` characters."""
    if isinstance(value, str) and len(value) > limit:
        value = value[:limit]
        shown = ascii(value)[: limit * 2] + "..."
    else:
        shown = ascii(value)
        if len(shown) > limit * 2:
            shown = shown[: limit * 2] + "..."
    return shown


def status_phrase(status: int) -> str:
    """The fixed reason phrase of an HTTP status (never request data: TorchServe copies it into the
    status line, and its framing counts characters where it writes UTF-8 bytes)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        # Every 503 says when to come back (RFC 9110 section 10.2.3: whole seconds); other statuses only
        # when the raiser says so.
        if retry_after is None and status == 503:
            retry_after = DEFAULT_RETRY_AFTER_S
        self.retry_after = None if retry_after is None else max(0, int(retry_after))
        # The param names a field; one from the request (an unknown field's name) is echoed safely.
        self.param = param if param is None or SAFE_PARAM.fullmatch(param) else echo(param)

    def headers(self) -> dict[str, str]:
        """The response headers this error adds (``Retry-After``), for either edge."""
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def native_json(self) -> dict:
        return {"code": self.status, "type": self.code, "message": self.message}

    def native_text(self, marker: str = "") -> str:
        """The native rendering, with the end-of-stream marker (a setting) never appearing in it."""
        return hide_marker(json.dumps(self.native_json()), marker)

    def openai_json(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def openai_text(self, marker: str = "") -> str:
        return hide_marker(json.dumps(self.openai_json()), marker)

    def anthropic_json(self) -> dict:
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message, "code": self.code}}

    def anthropic_text(self, marker: str = "") -> str:
        return hide_marker(json.dumps(self.anthropic_json()), marker)

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.code!r}, {self.message!r})"


def hide_marker(json_text: str, marker: str) -> str:
    """``json_text`` with every occurrence of ``marker`` broken by a JSON escape of its first character,
    which parses to the same value. Settings guarantee the marker starts with a character that can only
    occur inside a JSON string here (not a quote, brace, digit or space), so the escape stays valid."""
    if not marker or marker not in json_text:
        return json_text
    return json_text.replace(marker, f"\\u{ord(marker[0]):04x}" + marker[1:])


def model_not_found(model: object, model_name: str | tuple[str, ...], adapters: Iterable[str] = (),
                    param: str | None = "model") -> ApiError:
    """404 for a request naming a model this server does not serve, listing the ones it does: the base
    model's names (``model_name``: one, or MODEL_NAME and its SERVED_MODEL_NAME aliases), then its LoRA
    adapters."""
    names = (model_name,) if isinstance(model_name, str) else model_name
    served = ", ".join(repr(n) for n in [*names, *sorted(adapters)])
    return ApiError(404, "model_not_found", f"The model {echo(model)} does not exist; this server serves {served}",
                    param)


def internal_error(message: str = "generation failed") -> ApiError:
    return ApiError(500, "internal_error", message)
