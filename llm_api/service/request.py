"""What a request asks for once its format (native, OpenAI) has been parsed: ``GenerateRequest``.

Every front end turns its body into one of these (or a ``CancelRequest``) and hands it to the service;
nothing below the request formats knows which format a request came in. ``Limits`` is what the server
accepts, from the settings and the loaded model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llm_api.engine.sampling_params import SamplingParams
from llm_api.structured.spec import Constraint

if TYPE_CHECKING:
    from llm_api.text.reasoning import ReasoningFormat
    from llm_api.text.tools import GenericPrompt, ToolFormat

INPUT_FIELDS = ("text", "messages", "inputs_embeds")  # the native format's inputs (one of them)
PROMPT_KINDS = INPUT_FIELDS + ("token_ids",)  # every way a request holds its prompt (completions: token ids too)
DEFAULT_MAX_NEW_TOKENS = 256
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Limits:
    max_input_tokens: int
    max_new_tokens: int
    hidden_size: int | None = None
    vocab_size: int | None = None  # the model's logits width: logit_bias ids must be below it
    max_n: int = 128  # choices per request (MAX_NUM_SEQS: all n sequences run together)
    tool_format: "ToolFormat | None" = None  # how the model writes tool calls; None: no tools served
    max_request_work: int | None = None  # MAX_REQUEST_WORK (llm_api.service.admission.request_work); None: no bound
    reasoning_format: "ReasoningFormat | None" = None  # how answers split into reasoning and answer; None: not
    # tool_choice auto on a template without a tool format, in the generic form (GENERIC_TOOL_CHOICE_AUTO);
    # false: refused as vLLM refuses auto without a tool parser
    generic_tool_choice_auto: bool = True
    priority_scheduling: bool = False  # SCHEDULING_POLICY=priority: a request's priority is taken, else only 0


# The base model's names as a parser takes them: one name, or MODEL_NAME then its SERVED_MODEL_NAME aliases.
ModelNames = str | tuple[str, ...]


def names_of(model_names: ModelNames) -> tuple[str, ...]:
    return (model_names,) if isinstance(model_names, str) else model_names


def adapter_of(model: str, model_names: ModelNames) -> str | None:
    """The LoRA adapter a request's ``model`` names: None for any of the base model's names."""
    return None if model in names_of(model_names) else model


@dataclass(frozen=True)
class WorkFields:
    """What the request's format calls the fields ``llm_api.service.admission.request_work`` multiplies (its
    refusal names them)."""

    n: str = "n"
    max_new_tokens: str = "max_new_tokens"
    logprobs: str = "logprobs"


@dataclass
class GenerateRequest:
    text: str | None = None  # tokenized as is (control-token text included: raw by design)
    messages: list[dict] | None = None  # rendered with the chat template; contents are data
    inputs_embeds: list[list[float]] | None = None
    token_ids: list[int] | None = None  # the prompt as token ids (checked below the vocabulary size)
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # vLLM's: lower first (SCHEDULING_POLICY=priority; else always 0)
    stream: bool = True  # HTTP always streams; gRPC streams only when asked (see docs/torchserve.md)
    client_request_id: str | None = None  # the client's label: unique among live requests
    timeout_s: float | None = None
    output: str = "text"  # native answers: "text" (chunks then the marker) or "jsonl" (llm_api.protocols.native.encoder)
    constraint: Constraint | None = None  # structured output; the service compiles it into params.grammar
    tools: list[dict] | None = None  # tool definitions rendered by the chat template ({"type": "function", ...})
    template_kwargs: dict | None = None  # extra variables of the chat template (chat_template_kwargs, reasoning_effort)
    # A model without a tool format (llm_api.text.tools, generic form): the tools block added to the system
    # turn; the template is then not given ``tools`` (they are checked for control text all the same).
    tool_prompt: GenericPrompt | None = None
    work_fields: WorkFields = field(default_factory=WorkFields)  # (the format's names, for the work refusal)
    # The LoRA adapter to answer with (None: the base model), and the field that named it (errors name it).
    adapter: str | None = None
    adapter_param: str = "adapter"
    # /v1/completions' echo: each choice's answer begins with the prompt (with params.prompt_logprobs, with
    # its tokens' logprobs, the first token's None); echo_only (max_tokens 0): the prompt alone, the one
    # token the engine samples after it is dropped.
    echo: bool = False
    echo_only: bool = False
    # The token limit is a ceiling (Anthropic's max_tokens): cut to what the KV cache holds after the prompt
    # rather than refused with prompt_too_long (InputProcessor.prepare).
    max_tokens_fits: bool = False

    @property
    def input_kind(self) -> str:
        return next(k for k in PROMPT_KINDS if getattr(self, k) is not None)

    def num_input_chars(self) -> int:
        """Characters of text the tokenizer would see (a lower bound on work, an upper one on tokens)."""
        if self.text is not None:
            return len(self.text)
        if self.messages is not None:
            chars = sum(len(m.get("content") or "") + len(m.get("reasoning_content") or "") for m in self.messages)
            calls = [m["tool_calls"] for m in self.messages if m.get("tool_calls")]
            extra: list = [self.tools] if self.tools else []
            extra += [self.template_kwargs] if self.template_kwargs else []
            return (chars + sum(len(json.dumps(x, ensure_ascii=False)) for x in calls + extra)
                    + len(self.tool_prompt.block if self.tool_prompt else ""))
        return 0


@dataclass(frozen=True)
class CancelRequest:
    target_id: str  # the server-issued id of the request to end (x-request-id)


@dataclass(frozen=True)
class TokenizeRequest:
    """What the tokenize route asks the service to tokenize: a prompt, or chat messages (the template with
    the generation prompt), and whether the tokenizer adds its special tokens."""

    text: str | None
    messages: list[dict] | None
    add_special_tokens: bool
