"""The Responses API's body (``ResponsesBody``) and its input items, tools, text format and reasoning
config (``translate`` has the contract); ``check_call_ids``: every ``function_call_output`` answers a call
of the conversation."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from llm_api.errors import ApiError, echo
from llm_api.protocols.common.checks import PRIORITY_RANGE
from llm_api.protocols.common.fields import Integer, Number, StrictFlag, StrictWholeNumber, Text, check_text, fail
from llm_api.protocols.common.openai import ToolName
from llm_api.text.reasoning import REASONING_EFFORTS

MAX_INPUT_ITEMS = 2048  # items of ``input`` (a conversation longer than this cannot fit a prompt here anyway)
MAX_PARTS = 256  # content parts of one message
MAX_TOOLS = 128  # OpenAI allows 128 function tools
# Texts of one request together: the service's exact prompt check (MAX_INPUT_TOKENS x the vocabulary's
# longest token) comes later; this early bound refuses a text that cannot fit whatever the tokenizer,
# naming the field, before it is copied into messages.
MAX_CHARS_PER_INPUT_TOKEN = 64
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's bounds
MAX_ID_CHARS = 256  # ids and labels the client sends (call_id, user, prompt_cache_key, ...)
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
MEDIA_PART_TYPES = ("input_image", "input_file", "input_audio", "input_video")  # refused by name: text-only models
SERVICE_TIERS = ("auto", "default")  # one tier here: these two mean it; flex/priority/scale are refused


def _bounded(limit: int):
    def check(value: str) -> str:
        if len(value) > limit:
            raise fail("text_value", f"must have at most {limit} characters, got {len(value)}")
        return value

    return AfterValidator(check)


Label = Annotated[Text, _bounded(MAX_ID_CHARS)]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextPart(_Strict):
    # output_text parts come back from earlier answers with their annotations and logprobs (output
    # metadata: nothing the template renders)
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = Field(default=None, max_length=0)
    logprobs: list[Any] | None = None


class InputTextPart(_Strict):
    type: Literal["input_text"]
    text: Text


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: TextOr(TextPart)
    id: Label | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: Label
    name: ToolName
    arguments: Text  # JSON text of an object (checked where the error can name the item)
    id: Label | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: Label
    output: TextOr(InputTextPart)
    id: Label | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningPart(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: Label | None = None
    summary: Annotated[list[ReasoningPart], Field(max_length=MAX_PARTS)] = []
    content: Annotated[list[ReasoningPart], Field(max_length=MAX_PARTS)] | None = None
    encrypted_content: None = None  # nothing here encrypts reasoning, so none can be read back
    status: ItemStatus | None = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "\n\n".join(p.text for p in parts)


# Unions are tagged, so that an error is reported for the branch the value is (a list's error, not the
# string's); tags start with TAG_MARK and are left out of the field path an error names.
TAG_MARK = "~"


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return TAG_MARK + str(value.get("type", "message"))
    kind = getattr(value, "type", None)
    return None if kind is None else TAG_MARK + kind


def _text_or_list(value: Any) -> str:
    return TAG_MARK + ("list" if isinstance(value, list) else "text")


def TextOr(parts: Any) -> Any:  # noqa: N802 (a type factory)
    """A string or a list of ``parts`` (at most MAX_PARTS), tagged by the value's JSON type."""
    return Annotated[Union[Annotated[Text, Tag(TAG_MARK + "text")],
                           Annotated[list[parts], Field(max_length=MAX_PARTS), Tag(TAG_MARK + "list")]],
                     Discriminator(_text_or_list)]


InputItem = Annotated[Union[Annotated[MessageItem, Tag(TAG_MARK + "message")],
                            Annotated[FunctionCallItem, Tag(TAG_MARK + "function_call")],
                            Annotated[FunctionCallOutputItem, Tag(TAG_MARK + "function_call_output")],
                            Annotated[ReasoningItem, Tag(TAG_MARK + "reasoning")]], Discriminator(_item_kind)]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: ToolName
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema; None: no arguments
    strict: StrictFlag | None = None  # accepted: arguments always follow the schema here


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: ToolName | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: Text | None = None
    strict: StrictFlag | None = None  # accepted: the answer always follows the schema here


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    effort: Literal[REASONING_EFFORTS] | None = None
    summary: None = None  # no summaries are written here: refused unless null
    generate_summary: None = None


def _metadata(value: Any) -> Any:
    if not isinstance(value, dict):
        raise fail("metadata_type", "must be an object mapping strings to strings")
    if len(value) > MAX_METADATA_KEYS:
        raise fail("metadata_value", f"has {len(value)} keys; at most {MAX_METADATA_KEYS} are allowed")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise fail("metadata_value", f"keys must have at most {MAX_METADATA_KEY_CHARS} characters; "
                       f"{echo(key)} has {len(key)}")
        if not isinstance(item, str):
            raise fail("metadata_type", f"values must be strings; the value of {echo(key)} is not")
        if len(item) > MAX_METADATA_VALUE_CHARS:
            raise fail("metadata_value", f"values must have at most {MAX_METADATA_VALUE_CHARS} characters; the "
                       f"value of {echo(key)} has {len(item)}")
    return value


def _check_texts(value: dict) -> dict:
    for key, item in value.items():
        check_text(key)
        check_text(item)
    return value


Metadata = Annotated[dict[str, str], BeforeValidator(_metadata), AfterValidator(_check_texts)]


class ResponsesBody(_Strict):
    model: Text
    input: Annotated[Union[Annotated[Text, Tag(TAG_MARK + "text")],
                           Annotated[list[InputItem], Field(min_length=1, max_length=MAX_INPUT_ITEMS),
                                     Tag(TAG_MARK + "list")]], Discriminator(_text_or_list)]
    instructions: Text | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name"}: checked below
    parallel_tool_calls: StrictFlag | None = None
    text: TextConfig | None = None
    max_output_tokens: StrictWholeNumber | None = None
    temperature: Number(0.0, 2.0, text_ok=False) | None = None
    top_p: Number(0.0, 1.0, low_open=True, text_ok=False) | None = None
    presence_penalty: Number(-2.0, 2.0, text_ok=False) | None = None  # (OpenResponses' fields, as on chat)
    frequency_penalty: Number(-2.0, 2.0, text_ok=False) | None = None
    stream: StrictFlag = False
    store: StrictFlag = True
    previous_response_id: Label | None = None
    metadata: Metadata | None = None
    user: Label | None = None
    reasoning: ReasoningConfig | None = None
    include: Annotated[list[Text], Field(max_length=0)] | None = None  # nothing optional is served (see below)
    truncation: Literal["disabled"] | None = None
    background: StrictFlag | None = None  # queued and polled (llm_api.protocols.responses.route); needs store
    service_tier: Literal[SERVICE_TIERS] | None = None
    prompt_cache_key: Label | None = None  # a routing hint; the prefix cache here needs none
    safety_identifier: Label | None = None  # like user: a label for abuse reports; nothing here uses it
    ignore_eos: StrictFlag = False  # vLLM's extension, as on chat: generate past EOS up to max_output_tokens
    priority: Integer(*PRIORITY_RANGE, text_ok=False) | None = None  # vLLM's, as on chat (common.checks)


def check_call_ids(prior: list[dict], items: list) -> None:
    """Every function_call_output answers a call made before it in the conversation (OpenAI refuses the
    others)."""
    known = {c["id"] for t in prior for c in t.get("tool_calls") or ()}
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            known.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in known:
            raise ApiError(400, "invalid_value", f"'input[{i}].call_id' {echo(item.call_id)} answers no function call "
                           "of the conversation", f"input[{i}].call_id")
