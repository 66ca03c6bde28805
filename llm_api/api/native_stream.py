"""The native response: text deltas in, the bytes a ``/predictions`` or gRPC client receives out.

A ``NativeStream`` knows whether its client reads a stream (HTTP, gRPC ``StreamPredictions`` with
``stream=true``) or one message (unary gRPC ``Predictions``, or ``stream=false``). Its contract with
clients:

* a streaming client gets text deltas as chunks, then a final chunk that ends with the end-of-stream
  marker; the marker appears nowhere else (the detokenizer strips it from model text, and error
  renderings break it, see ``ApiError.native_text``);
* a unary client gets the whole text followed by the marker in one message;
* a request that fails after its stream began ends with an error line (a JSON object with ``code``,
  ``type`` and ``message``) and no marker, so no client mistakes it for a full answer; one that fails
  before anything was sent gets the error object alone (the edge sends it with the error's status).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_api.api.errors import ApiError


@dataclass
class NativeStream:
    marker: str
    streaming: bool
    started: bool = False  # a chunk was sent: errors must go in-band from now on
    _held: list[str] = field(default_factory=list)  # text of a unary response, sent at the end

    def delta(self, text: str) -> str:
        """New text -> the chunk to send now ("" for a unary client, which gets everything at the end)."""
        if not text:
            return ""
        if not self.streaming:
            self._held.append(text)
            return ""
        self.started = True
        return text

    def finish(self) -> str:
        """The final payload of a complete answer: the marker (after the held text when unary)."""
        if self.streaming:
            return self.marker
        return "".join(self._held) + self.marker

    def fail(self, error: ApiError) -> str:
        """The final payload of a request that broke after it was accepted."""
        text = error.native_text(self.marker)
        return "\n" + text if self.started else text
