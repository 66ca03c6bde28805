"""What a request asks for once its format (native, OpenAI) has been parsed: ``GenerateRequest``.

Every front end turns its body into one of these (or a ``CancelRequest``) and hands it to the service;
nothing below the request formats knows which format a request came in. ``Limits`` is what the server
accepts, from the settings and the loaded model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_api.engine.sampler import SamplingParams

INPUT_FIELDS = ("text", "messages", "inputs_embeds")
DEFAULT_MAX_NEW_TOKENS = 256
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Limits:
    max_input_tokens: int
    max_new_tokens: int
    hidden_size: int | None = None
    vocab_size: int | None = None  # the model's logits width: logit_bias ids must be below it
    max_n: int = 128  # choices per request (MAX_NUM_SEQS: all n sequences run together)


@dataclass
class GenerateRequest:
    text: str | None = None  # tokenized as is (control-token text included: raw by design)
    messages: list[dict] | None = None  # rendered with the chat template; contents are data
    inputs_embeds: list[list[float]] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = True  # HTTP always streams; gRPC streams only when asked (see docs/torchserve.md)
    client_request_id: str | None = None  # the client's label: unique among live requests
    timeout_s: float | None = None
    output: str = "text"  # native answers: "text" (chunks then the marker) or "jsonl" (llm_api.api.native_stream)

    @property
    def input_kind(self) -> str:
        return next(k for k in INPUT_FIELDS if getattr(self, k) is not None)

    def num_input_chars(self) -> int:
        """Characters of text the tokenizer would see (a lower bound on work, an upper one on tokens)."""
        if self.text is not None:
            return len(self.text)
        if self.messages is not None:
            return sum(len(m.get("content") or "") for m in self.messages)
        return 0


@dataclass(frozen=True)
class CancelRequest:
    target_id: str  # the server-issued id of the request to end (x-request-id)
