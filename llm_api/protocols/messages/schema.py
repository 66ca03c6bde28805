"""Anthropic Messages' bodies (``MessagesBody``, ``CountTokensBody``) and their parts, as the ``anthropic`` SDK
(2.x) and Claude Code send them (``llm_api.protocols.messages.translate`` has the contract).

The body's own fields are declared here; a field not declared is a 400 naming it. Content blocks and tool
definitions are checked one by one in ``translate`` (``BLOCKS``, ``ToolDefinition``), so an error names
the block (``messages[2].content[1].input``) rather than pydantic's union branches. Fields that only
steer Anthropic's own service (``cache_control``: our prefix cache needs no marks; ``inference_geo``,
``speed``, ``service_tier``; a tool's ``defer_loading`` and ``allowed_callers``, a block's ``caller``)
are accepted and change nothing; fields naming work this server cannot do (``container``: a code-execution
sandbox; image and document blocks; server tools) are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from llm_api.protocols.common.fields import Integer, Number, StopStrings, StrictFlag, StrictWholeNumber, Text, nonempty_list
from llm_api.protocols.common.openai import ToolName  # (Anthropic's rule for tool names is OpenAI's)

MAX_STOP_SEQUENCES = 16
MAX_USER_ID_CHARS = 256


class CacheControl(BaseModel):
    """A prompt-cache breakpoint: accepted, changes nothing (the prefix cache finds shared prefixes itself)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class Block(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cache_control: CacheControl | None = None


class TextBlock(Block):
    type: Literal["text"]
    text: Text
    citations: list[dict] | None = None  # citations of an earlier answer: kept out of the prompt


class ToolUseBlock(Block):
    """A call the assistant made, sent back as history (the answer's ``tool_use`` blocks)."""

    type: Literal["tool_use"]
    id: Text
    name: ToolName
    input: dict
    caller: dict | None = None  # Anthropic's programmatic tool calling: who called it; not used here
    toolset_name: Text | None = None


class ToolResultBlock(Block):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[Any] | None = None  # text, or text blocks (checked in translate)
    is_error: StrictFlag | None = None
    toolset_name: Text | None = None


class ThinkingBlock(Block):
    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None  # Anthropic's proof of origin; this server signs nothing and checks nothing


class RedactedThinkingBlock(Block):
    type: Literal["redacted_thinking"]
    data: Text  # encrypted by Anthropic: nothing here can read it, so it leaves the prompt out


# The blocks a message may hold, by ``type``, and the roles whose messages may hold each.
BLOCKS: dict[str, tuple[type[Block], tuple[str, ...]]] = {
    "text": (TextBlock, ("user", "assistant", "system")),
    "tool_use": (ToolUseBlock, ("assistant",)),
    "tool_result": (ToolResultBlock, ("user",)),
    "thinking": (ThinkingBlock, ("assistant",)),
    "redacted_thinking": (RedactedThinkingBlock, ("assistant",)),
}
# Blocks of Anthropic's API this server cannot read (a text-only model; no server tools), refused by name.
UNSERVED_BLOCKS = ("image", "document", "search_result", "container_upload", "server_tool_use",
                   "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                   "mcp_tool_use", "mcp_tool_result")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # "system" inside messages: what Claude Code sends since 2.1.154 (taken as a system turn where it stands)
    role: Literal["user", "assistant", "system"]
    content: Text | list[Any]  # a string, or blocks (each checked in translate against BLOCKS)


class ToolDefinition(BaseModel):
    """A client tool (the only kind served: its calls come back to the client as ``tool_use`` blocks)."""

    model_config = ConfigDict(extra="forbid")

    name: ToolName
    description: Text | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: StrictFlag | None = None  # accepted; calls always follow the schema here
    input_examples: list[dict] | None = None  # not rendered (no chat template has a place for them)
    eager_input_streaming: StrictFlag | None = None  # the input is always streamed as it is written here
    defer_loading: StrictFlag | None = None  # (tool search) every tool is always loaded here
    allowed_callers: list[Any] | None = None

    @model_validator(mode="after")
    def _object_schema(self):
        if self.input_schema.get("type") != "object":
            raise ValueError("'input_schema' must be a JSON schema of type object")
        return self


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: StrictFlag | None = None

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.name is None) == (self.type == "tool"):
            raise ValueError("'name' is required with type tool, and allowed only there")
        return self


class Thinking(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictWholeNumber | None = None  # enabled: required, at least 1, below max_tokens
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget(self):
        if (self.budget_tokens is None) == (self.type == "enabled"):
            raise ValueError("'budget_tokens' is required with type enabled, and allowed only there")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise ValueError("'budget_tokens' must be at least 1")
        return self


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: Annotated[Text, Field(max_length=MAX_USER_ID_CHARS)] | None = None


def _no_value(name: str):
    def check(value: Any) -> Any:
        if value is not None:
            raise ValueError(f"is not served here ({name})")
        return value
    return BeforeValidator(check)


class CountTokensBody(BaseModel):
    """``POST v1/messages/count_tokens``: what the prompt is made of (no generation fields)."""

    model_config = ConfigDict(extra="forbid")

    model: Text
    messages: Annotated[list[Message], BeforeValidator(nonempty_list)]
    system: Text | list[TextBlock] | None = None
    tools: list[dict] | None = None  # each checked in translate against ToolDefinition (server tools refused)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None


class MessagesBody(CountTokensBody):
    """``POST v1/messages``."""

    max_tokens: StrictWholeNumber  # required, as Anthropic requires it
    stream: StrictFlag = False
    stop_sequences: StopStrings(MAX_STOP_SEQUENCES) | None = None
    temperature: Number(0.0, 1.0, text_ok=False) | None = None  # Anthropic's range
    top_p: Number(0.0, 1.0, low_open=True, text_ok=False) | None = None
    top_k: Integer(0, 1_000_000, text_ok=False) | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: Text | None = None
    container: Annotated[Any, _no_value("a code-execution container")] = None
    diagnostics: dict | None = None
