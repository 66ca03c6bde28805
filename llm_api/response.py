"""One request's output at the edge: token ids in, the bytes its client receives out.

A ``ResponseStream`` owns the request's ``TextStream`` (detokenizing, stop strings, marker guard) and
knows whether its client reads a stream (HTTP, gRPC ``StreamPredictions`` with ``stream=true``) or one
message (unary gRPC ``Predictions``, or ``stream=false``). Its contract with clients:

* a streaming client gets text deltas as chunks, then a final chunk that ends with the end-of-stream
  marker; the marker appears nowhere else;
* a unary client gets the whole text followed by the marker in one message;
* a request that fails after its stream began ends with an error line (a JSON object with
  ``code``, ``type`` and ``message``) and no marker, so no client mistakes it for a full answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from llm_api.detokenizer import TextStream


@dataclass
class ResponseStream:
    request_id: str
    text_stream: TextStream
    marker: str
    streaming: bool
    num_generated_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    started: bool = False  # a chunk was sent: errors must go in-band from now on
    _held: list[str] = field(default_factory=list)  # text of a unary response, sent at the end

    def push(self, token_ids: list[int]) -> tuple[str, bool]:
        """New tokens -> (chunk to send now, stop string matched)."""
        self.num_generated_tokens += len(token_ids)
        delta = self.text_stream.push(token_ids)
        return self._emit(delta.text), delta.stopped

    def finish(self, reason: str | None) -> str:
        """The final payload: what is left, then the marker."""
        self.finished = True
        self.finish_reason = reason
        tail = self._emit(self.text_stream.finish())
        if self.streaming:
            return tail + self.marker
        return "".join(self._held) + self.marker

    def fail(self, code: int, type_: str, message: str) -> str:
        """The final payload of a request that broke after it was accepted."""
        self.finished = True
        self.finish_reason = "error"
        error = json.dumps({"code": code, "type": type_, "message": message})
        if self.streaming:
            return "\n" + error if self.started else error
        return error

    def _emit(self, text: str) -> str:
        if not text:
            return ""
        if self.streaming:
            self.started = True
            return text
        self._held.append(text)
        return ""
