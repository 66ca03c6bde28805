"""The native response: service events in, the bytes a ``/predictions`` or gRPC client receives out.

A ``NativeStream`` knows whether its client reads a stream (HTTP, gRPC ``StreamPredictions`` with
``stream=true``) or one message (unary gRPC ``Predictions``, or ``stream=false``), and which output the
request chose (``output``). Its contract with clients:

* ``output: "text"`` (the default, unchanged for existing clients): a streaming client gets text deltas
  as chunks, then a final chunk that ends with the end-of-stream marker; the marker appears nowhere else
  (the detokenizer strips it from model text, and error renderings break it, see
  ``ApiError.native_text``);
* ``output: "jsonl"`` (needed for ``n`` > 1 and ``logprobs``): JSON lines, each ending in ``\\n``:
  ``{"index", "text"}`` per delta (with ``"logprobs"``: ``[{token, token_id, logprob, top_logprobs}]``
  when asked for), ``{"index", "finish_reason", "completion_tokens"}`` when a choice ends, and a last
  ``{"usage": {prompt_tokens, completion_tokens, total_tokens}}`` line followed by the marker. Lines of
  different choices interleave; the marker inside a line is escaped like in errors, so it still appears
  only at the very end;
* a unary client gets the whole answer (text, or all the lines) followed by the marker in one message;
  over gRPC that message may not exceed ``max_unary_bytes`` (the edge sets 4 MiB, gRPC's default message
  limit, below TorchServe's ``max_response_size``, beyond which the worker dies): a larger answer (many
  choices with logprobs) fails with ``response_too_large`` instead, as soon as it is known, telling the
  client to stream;
* a request that fails after its stream began ends with an error line (a JSON object with ``code``,
  ``type`` and ``message``) and no marker, so no client mistakes it for a full answer; one that fails
  before anything was sent gets the error object alone (the edge sends it with the error's status).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from llm_api.engine.request import FinishReason
from llm_api.errors import ApiError, hide_marker
from llm_api.text.logprobs import LogprobItem, native_logprobs

OUTPUT_FORMATS = ("text", "jsonl")
TEXT_CONTENT_TYPE = "text/plain; charset=utf-8"  # output "text"
NDJSON_CONTENT_TYPE = "application/x-ndjson; charset=utf-8"  # output "jsonl"
GRPC_MAX_MESSAGE_BYTES = 4 * 2**20 - 4096  # gRPC clients' default receive limit, less room for the envelope


@dataclass
class NativeStream:
    marker: str
    streaming: bool
    json_lines: bool = False  # output "jsonl"
    with_logprobs: bool = False  # (json lines only) every delta line carries "logprobs"
    max_unary_bytes: int | None = None  # the most a unary answer may hold (None: no limit)
    started: bool = False  # a chunk was sent: errors must go in-band from now on
    _held: list[str] = field(default_factory=list)  # text of a unary response, sent at the end
    _held_bytes: int = 0

    @property
    def content_type(self) -> str:
        return NDJSON_CONTENT_TYPE if self.json_lines else TEXT_CONTENT_TYPE

    def delta(self, text: str, index: int = 0, logprobs: tuple[LogprobItem, ...] = (), num_tokens: int = 0) -> str:
        """New text of a choice -> the chunk to send now ("" for a unary client, which gets everything at
        the end)."""
        if self.json_lines:
            if not text and not logprobs:
                return ""
            line = {"index": index, "text": text}
            if self.with_logprobs:
                line["logprobs"] = native_logprobs(list(logprobs))
            return self._out(self._line(line))
        return self._out(text)

    def choice_finish(self, index: int, reason: FinishReason, num_tokens: int = 0,
                      stop_sequence: str | None = None) -> str:
        if not self.json_lines:
            return ""
        return self._out(self._line({"index": index, "finish_reason": reason.value, "completion_tokens": num_tokens}))

    def finish(self, reason: FinishReason | None = None, num_prompt_tokens: int = 0, num_generated_tokens: int = 0,
               num_cached_tokens: int = 0) -> str:
        """The final payload of a complete answer: the marker (after the held text when unary); ``reason``
        is in the choices' lines already. (The native usage line has no cached-token count.)"""
        tail = ""
        if self.json_lines:
            tail = self._line({"usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_generated_tokens,
                                         "total_tokens": num_prompt_tokens + num_generated_tokens}})
        if self.streaming:
            return tail + self.marker
        return "".join(self._held) + tail + self.marker

    def fail(self, error: ApiError) -> str:
        """The final payload of a request that broke after it was accepted."""
        text = error.native_text(self.marker)
        if self.json_lines:
            text += "\n"  # its own line, like every other
        return "\n" + text if self.started and not self.json_lines else text

    def refusal(self, error: ApiError) -> str:
        return error.native_text(self.marker)

    def _out(self, chunk: str) -> str:
        if not chunk:
            return ""
        if not self.streaming:
            self._held.append(chunk)
            self._held_bytes += len(chunk.encode("utf-8"))
            if self.max_unary_bytes is not None and self._held_bytes > self.max_unary_bytes:
                raise ApiError(400, "response_too_large", f"the answer exceeds {self.max_unary_bytes} bytes, the most "
                               "one message carries: stream it (StreamPredictions with stream=true), or ask for fewer "
                               "tokens, choices or logprobs")
            return ""
        self.started = True
        return chunk

    def _line(self, obj: dict) -> str:
        return hide_marker(json.dumps(obj, ensure_ascii=False), self.marker) + "\n"
