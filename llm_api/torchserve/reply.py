"""One request's answer through TorchServe's context: chunks, the final message, refusals.

``Reply(context, idx, async_mode)`` wraps row ``idx`` of a ``handle()`` call. The edge sends text with
``send`` (one ``send_intermediate_predict_response`` per call: a chunk of an HTTP chunked response or
one gRPC stream message) and ends with the value ``finish``/``refuse`` return, which ``handle()`` returns
for that row as the final message. TorchServe 0.12 behaviours this is shaped by (docs/torchserve.md):

* the backend cannot tell unary gRPC ``Predictions`` from ``StreamPredictions``; every gRPC answer
  that was not streamed is one message marked ``ts_stream_next: false`` (a StreamPredictions call
  without it throws in the frontend and kills the worker; a unary call ignores it), and HTTP must not
  get that header on a non-streamed answer (the frontend would then skip the response head);
* in async mode a final message that follows no chunk is never removed from the frontend's job table,
  so a 200 answer there goes out as a chunk and the final message only closes it; a refusal cannot (the
  frontend closes the connection right after the head of a >= 400 response), so it is the exception;
* a status set for one row is that row's alone (``set_response_status(code, phrase, idx)``); the phrase
  is a fixed ASCII text per status, never a message: the frontend copies it into the HTTP status line,
  and the worker protocol frames it by character count while writing UTF-8 bytes, so one non-ASCII
  character desynchronizes the frontend and kills the worker;
* HTTP requests carry their headers (``url_path`` among them); gRPC requests carry none;
* a message larger than ``max_response_size`` (6,553,500 bytes by default) kills the worker: an HTTP
  payload (a non-streamed answer with logprobs and n choices can reach megabytes) goes out in pieces of
  at most ``MAX_MESSAGE_CHARS`` characters (64 KiB of UTF-8 at most, below any sensible setting), which
  the client receives as one chunked body; a gRPC answer cannot be split (a unary call takes one
  message), so the native encoder bounds it (``llm_api.protocols.native.encoder``).
"""

from __future__ import annotations

from ts.handler_utils.utils import send_intermediate_predict_response

from llm_api.errors import status_phrase
from llm_api.protocols.native.encoder import TEXT_CONTENT_TYPE

MAX_MESSAGE_CHARS = 16 * 1024
JSON_CONTENT_TYPE = "application/json"


class Reply:
    def __init__(self, context, idx: int, async_mode: bool):
        self.context = context
        self.idx = idx
        self.async_mode = async_mode
        headers = context.request_processor[idx].get_request_properties() if context.request_processor else {}
        self.is_grpc = not any(isinstance(v, str) for v in headers.values())
        # The request's HTTP headers, lower-case names (gRPC requests carry none).
        self.headers = {str(k).lower(): v for k, v in headers.items() if isinstance(v, str)}
        url_path = headers.get("url_path")
        # What followed /predictions/<model>/<version>/ (None over gRPC, or for the bare path).
        self.url_path = url_path if isinstance(url_path, str) and url_path.strip("/") else None
        self.request_id = context.get_request_id(idx) or ""
        self.started = False  # a chunk went out: the status is 200 and errors must go in-band

    def send(self, payload: str | bytes, content_type: str = TEXT_CONTENT_TYPE) -> None:
        if not payload:
            return
        if not self.started:
            self.context.set_response_content_type(self.idx, content_type)
        pieces = [payload] if self.is_grpc else _pieces(payload)
        for piece in pieces:
            # Keyed by row: TorchServe reads ret[idx] for every idx of the id map.
            send_intermediate_predict_response({self.idx: piece}, {self.idx: self.request_id}, "Intermediate", 200,
                                               self.context)
        self.started = True

    def finish(self, payload: str | bytes, content_type: str = TEXT_CONTENT_TYPE):
        """The final message of a 200 answer (``payload`` may be the whole answer when nothing was sent)."""
        if not self.is_grpc and len(payload) > MAX_MESSAGE_CHARS:
            self.send(payload[:-MAX_MESSAGE_CHARS], content_type)  # (the rest is small enough to end with)
            payload = payload[-MAX_MESSAGE_CHARS:]
        if self.is_grpc or not self.async_mode or self.started:
            if not self.started:
                self.context.set_response_content_type(self.idx, content_type)
                if self.is_grpc:  # one message ends the call, stream or unary
                    self.context.set_response_header(self.idx, "ts_stream_next", "false")
            return payload
        # Async HTTP with nothing sent yet: the answer goes out as a chunk; the final message closes it.
        self.send(payload, content_type)
        return ""

    def refuse(self, status: int, body: str | bytes, content_type: str = JSON_CONTENT_TYPE,
               headers: dict[str, str] | None = None):
        """A refusal before anything was sent: the error's status (a fixed phrase), its headers (an
        error's own: ``Retry-After``, never request data; the frontend copies a row's headers into its
        HTTP response, the error responses included) and its body."""
        self.context.set_response_status(status, status_phrase(status), self.idx)
        self.context.set_response_content_type(self.idx, content_type)
        for name, value in (headers or {}).items():
            self.context.set_response_header(self.idx, name, value)
        if self.is_grpc:
            self.context.set_response_header(self.idx, "ts_stream_next", "false")
        return body


def _pieces(payload: str | bytes) -> list[str | bytes]:
    return [payload[i : i + MAX_MESSAGE_CHARS] for i in range(0, len(payload), MAX_MESSAGE_CHARS)]
