"""Chat completions' body (``ChatBody``) and its parts: messages (text parts, earlier tool calls, tool
results, reasoning), tool definitions, ``response_format``, and the fields the openai package and agent
frameworks send (``llm_api.protocols.chat.translate`` has the contract)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from llm_api.protocols.common.fields import Integer, StrictFlag, StrictWholeNumber, Text, nonempty_list
from llm_api.protocols.common.openai import OpenAIBody, ToolName

MAX_CHAT_TOP_LOGPROBS = 20
MAX_METADATA_PAIRS = 16


def _content_shape(value: Any) -> Any:
    if isinstance(value, list) and not all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        raise ValueError("only text parts are supported")
    return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: Text


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: ToolName
    arguments: Text  # JSON text of an object (checked in parse_chat, where the error can name it)


class ToolCallItem(BaseModel):
    """One call of an earlier assistant turn, sent back as conversation history."""

    model_config = ConfigDict(extra="forbid")

    id: Text
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Text | list[TextPart], BeforeValidator(_content_shape)] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant turns only
    tool_call_id: Text | None = None  # tool turns only: the call this result answers
    reasoning: Text | None = None  # assistant turns only: its thinking (vLLM's name)
    reasoning_content: Text | None = None  # the same (DeepSeek's name); both given: the same text

    @model_validator(mode="after")
    def _role_rules(self):
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.thinking)):
            raise ValueError(f"a {self.role} message needs 'content'" +
                             (" or 'tool_calls' or 'reasoning'" if self.role == "assistant" else ""))
        if self.role != "assistant" and (self.reasoning is not None or self.reasoning_content is not None):
            raise ValueError("only assistant messages may carry 'reasoning' or 'reasoning_content'")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages may carry 'tool_calls'")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("a tool message needs 'tool_call_id'" if self.role == "tool"
                             else "only tool messages may carry 'tool_call_id'")
        return self

    def to_turn(self) -> dict:
        """Our chat turn: text parts joined; ``developer`` (OpenAI's newer name) as the system role; calls
        with their arguments as objects (what chat templates render; parse_chat checked the JSON)."""
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        turn: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        if self.thinking:
            turn["reasoning_content"] = self.thinking  # the name Qwen3's template reads
        return turn

    @property
    def thinking(self) -> str | None:
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: ToolName
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema; None: no arguments
    strict: StrictFlag | None = None  # accepted; arguments always follow the schema here


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class ResponseSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: ToolName
    description: Text | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: StrictFlag | None = None  # accepted; the answer always follows the schema here


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: ResponseSchema | None = None


def _metadata(value: Any) -> Any:
    # OpenAI's rule: at most 16 pairs, keys up to 64 characters, values strings up to 512.
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()):
        raise ValueError(f"must be an object of at most {MAX_METADATA_PAIRS} string values (keys up to 64 "
                         "characters, values up to 512)")
    return value


class Prediction(BaseModel):
    """Predicted output (OpenAI's ``prediction``): accepted; the n-gram drafter (SPECULATIVE_TOKENS) already
    proposes from the prompt, where a prediction that repeats the prompt's text is found anyway."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: Annotated[Text | list[TextPart], BeforeValidator(_content_shape)]


class ChatBody(OpenAIBody):
    messages: Annotated[list[ChatMessage], BeforeValidator(nonempty_list)]
    max_completion_tokens: StrictWholeNumber | None = None
    logprobs: StrictFlag | None = None
    top_logprobs: Integer(0, MAX_CHAT_TOP_LOGPROBS, text_ok=False) | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}: checked below
    parallel_tool_calls: StrictFlag | None = None
    chat_template_kwargs: Any = None  # an object of template variables: checked by template_variables
    reasoning_effort: Any = None  # one of reasoning.REASONING_EFFORTS: checked by template_variables
    # Fields the openai package and frameworks send: accepted as documented in the module docstring.
    store: StrictFlag | None = None
    metadata: Annotated[dict, BeforeValidator(_metadata)] | None = None
    service_tier: Literal["auto", "default", "flex", "priority", "scale"] | None = None
    modalities: list[Literal["text"]] | None = None
    prediction: Prediction | None = None
