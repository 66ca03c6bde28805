"""Prompt token ids from a ``GenerateRequest``: ``text`` as is, ``messages`` through the chat template.

``text`` is tokenized as is, control-token text included (raw by design: callers who send ``text`` own
the whole prompt). Chat ``messages`` are different: their contents are data, so text such as
``<|im_start|>system`` inside a message must never become the template's control tokens (a user could
forge a system turn). ``PromptBuilder.token_ids`` renders the template once with a unique placeholder
per message content, so it knows which characters of the rendered prompt came from the template and
which from the messages; the special tokens found in the template's own text stay special, and every
stretch in between (template text and message contents together, exactly as the tokenizer would
pre-tokenize them) is encoded with special-token matching off. For ordinary contents the ids equal
``apply_chat_template(..., tokenize=True)``. Without a fast tokenizer, or with a template that does not
keep each placeholder once and intact, contents holding special-token text are refused instead.

Tools (``request.tools``) are passed to the template's ``tools`` argument, and earlier calls (assistant
``tool_calls``) stay in their messages; the template renders them itself (as JSON, in the model's own
layout), so they cannot be kept as data the way contents are: a tool definition or an earlier call
holding special-token text anywhere (a description, a schema, an argument) is refused with a 400 naming
it. The same holds for an assistant turn's reasoning sent back (``reasoning_content`` / ``reasoning``,
e.g. a Responses API reasoning item). A tool result (``role: "tool"``) is a message content like any
other: data.

``request.template_kwargs`` (``chat_template_kwargs`` and ``reasoning_effort``) are extra variables of the
template's render (jinja2's sandbox, set up as transformers sets up its own: ``llm_api.model.tokenizer``). A
name the render already gives the template (``messages``, ``tools``, ``add_generation_prompt``, the special
tokens such as ``bos_token``, any parameter of transformers' ``apply_chat_template``) is refused, naming it;
so is special-token text in any string of a value or in an earlier turn's ``reasoning_content``: like tools,
the template renders them itself, so they cannot be kept as data the way contents are.

A model whose template has no tool format (``llm_api.text.tools``, generic form) is shown its tools by
``request.tool_prompt`` (``GenericPrompt``): a block added to the first system turn (or inserted as one)
and, for ``tool_choice`` auto, a nudge on the last turn; the template is not given ``tools``. Earlier calls
are written into their assistant turns' contents as ``Calling name(...)`` lines and each tool result is
headed by its function's name (``calls_as_text``). All of it becomes message contents, so data, but the
tool definitions and earlier calls are refused for control text first all the same, so one request gets
the same answer on every model.

``max_chars_per_token`` bounds the characters one token covers, so the service can refuse a prompt whose
characters cannot fit MAX_INPUT_TOKENS before tokenizing it (``llm_api.service.admission``, which holds every
limit: this module only tokenizes).
"""

from __future__ import annotations

import copy
import inspect
import re
import uuid

from llm_api.errors import ApiError
from llm_api.service.request import GenerateRequest
from llm_api.text.tools import GenericPrompt, calls_as_text, detect_tool_format

# What transformers' render gives every template besides the special tokens (a kwarg may not replace them).
TEMPLATE_NAMES = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                  "raise_exception", "strftime_now", "tojson", "namespace", "range", "loop", "self")


# transformers' ``apply_chat_template`` parameters (5.x): refused as template kwargs whichever tokenizer serves the
# model (ours, ``llm_api.model.tokenizer``, takes fewer), so one request gets one answer on every model.
CHAT_TEMPLATE_CALL_PARAMETERS = (
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs")


REASONING_KEYS = ("reasoning_content", "reasoning")  # an assistant turn's thinking, as templates read it


class PromptBuilder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tool_format = detect_tool_format(tokenizer)  # None: tools and calls in the generic form
        specials = sorted({t for t in tokenizer.all_special_tokens if t}, key=len, reverse=True)
        self._special_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
        self._special_pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._text_encoder = None  # a copy of the fast tokenizer that never matches special tokens
        if backend is not None and hasattr(backend, "encode_special_tokens"):
            self._text_encoder = copy.deepcopy(backend)
            self._text_encoder.encode_special_tokens = True
        vocab = tokenizer.get_vocab()
        # An upper bound on the characters one token covers (byte-level vocabularies spell one byte per
        # character, so a key's length bounds its decoded length too).
        self.max_chars_per_token = max(max(map(len, vocab), default=1), max(map(len, specials), default=1))
        # Names a template kwarg may not take: what the render already passes (and apply_chat_template's own
        # parameters, which a kwarg of that name would silently change).
        self.reserved_template_names = frozenset(TEMPLATE_NAMES) | frozenset(tokenizer.special_tokens_map) | \
            frozenset(CHAT_TEMPLATE_CALL_PARAMETERS) | frozenset(inspect.signature(tokenizer.apply_chat_template).parameters)

    # ----------------------------------------------------------------------------------------------

    def token_ids(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids (raises ApiError: no chat template, a template error)."""
        if request.token_ids is not None:  # (already checked below the vocabulary size by its format)
            return list(request.token_ids)
        return self.ids_of(request.text, request.messages, tools=request.tools, tool_prompt=request.tool_prompt,
                           template_kwargs=request.template_kwargs)

    def ids_of(self, text: str | None, messages: list[dict] | None, add_special_tokens: bool = True,
               tools: list[dict] | None = None, tool_prompt: GenericPrompt | None = None,
               template_kwargs: dict | None = None) -> list[int]:
        """``text`` (with the tokenizer's special tokens unless told not to) or chat ``messages`` (with the
        ``tools`` the chat template renders, or for a template without a tool format the generic
        ``tool_prompt`` in the system turn, and the extra variables ``template_kwargs``) -> ids."""
        if messages is not None:
            self._refuse_control_text_in_tools(messages, tools, template_kwargs)
            if self.tool_format is None:  # the generic form: calls as text, tools in the system turn
                messages = calls_as_text(messages)
                if tool_prompt is not None:
                    messages, tools = tool_prompt.apply(messages), None
            ids = self._chat_ids(messages, tools, template_kwargs or {})
        else:
            ids = list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        return ids

    # ----------------------------------------------------------------------------------------------

    def _refuse_control_text_in_tools(self, messages: list[dict], tools: list[dict] | None,
                                      template_kwargs: dict | None = None) -> None:
        for name in template_kwargs or ():
            if name in self.reserved_template_names:
                where = f"chat_template_kwargs.{name}"
                raise ApiError(400, "invalid_value", f"{where!r}: the chat template already gets {name!r}; a "
                               "template kwarg cannot replace it", where)
        if self._special_pattern is None:
            return
        tool_values = [(f"tools[{i}]", tool) for i, tool in enumerate(tools or ())]
        calls = [(f"messages[{i}].tool_calls", m["tool_calls"]) for i, m in enumerate(messages)
                 if m.get("tool_calls")]
        # An assistant turn's reasoning (sent back for interleaved thinking) is rendered as markup too.
        reasoning = [(f"messages[{i}].{key}", m[key]) for i, m in enumerate(messages)
                     for key in REASONING_KEYS if m.get(key)]
        variables = [(f"chat_template_kwargs.{name}", value) for name, value in (template_kwargs or {}).items()]
        for where, value in tool_values + calls + reasoning + variables:
            found = _find_in_strings(value, self._special_pattern)
            if found is not None:
                raise ApiError(400, "invalid_input", f"{where!r} holds the model's control token {found!r}; the "
                               f"chat template renders it as markup, so it cannot be kept as plain text", where)

    def _render(self, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None
                ) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "unsupported_input", "this model has no chat template; send 'text' instead")
        extra = dict(template_kwargs or {})
        if tools:
            extra["tools"] = tools
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        except Exception as exc:  # templates raise on role orders they do not support
            raise ApiError(400, "invalid_input", f"the chat template rejected these messages: "
                           f"{str(exc)[:200]}") from None

    def _chat_ids(self, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None
                  ) -> list[int]:
        # Only non-empty contents get a placeholder: templates test an empty content (an assistant turn
        # that only calls tools), and an empty content holds no text to keep as data anyway.
        with_text = [i for i, m in enumerate(messages) if m["content"]]
        placeholders = {i: f"\ue000{uuid.uuid4().hex}\ue001" for i in with_text}
        rendered = self._render([{**m, "content": placeholders.get(i, m["content"])} for i, m in enumerate(messages)],
                                tools, template_kwargs)
        pieces = _split_at(rendered, list(placeholders.values()))
        if pieces is None or self._text_encoder is None:
            return self._chat_ids_refusing_control_text(messages, tools, template_kwargs)
        # Assemble the real prompt, remembering where the template's own special tokens are.
        text, template_specials = "", []  # (start, end) in text of each special token of the template
        for i, markup in enumerate(pieces):
            if self._special_pattern is not None:
                template_specials += [(len(text) + m.start(), len(text) + m.end())
                                      for m in self._special_pattern.finditer(markup)]
            text += markup
            if i < len(with_text):
                text += messages[with_text[i]]["content"]
        ids, pos = [], 0
        for start, end in template_specials:
            ids += self._encode_text(text[pos:start])
            ids.append(self._special_ids[text[start:end]])
            pos = end
        ids += self._encode_text(text[pos:])
        return ids

    def _encode_text(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not: a long prompt tokenized on a
        # worker thread would still freeze the event loop; measured 0.8 s of lateness for 1.2 MB).
        assert self._text_encoder is not None  # _chat_ids comes here only when there is one
        return self._text_encoder.encode_batch([text], add_special_tokens=False)[0].ids if text else []

    def _chat_ids_refusing_control_text(self, messages: list[dict], tools: list[dict] | None = None,
                                        template_kwargs: dict | None = None) -> list[int]:
        for i, message in enumerate(messages):
            found = self._special_pattern.search(message["content"]) if self._special_pattern else None
            if found:
                raise ApiError(400, "invalid_input", f"messages[{i}].content holds the model's control token "
                               f"{found.group(0)!r}, which this tokenizer cannot keep as plain text")
        return list(self.tokenizer(self._render(messages, tools, template_kwargs),
                                   add_special_tokens=False)["input_ids"])


def _find_in_strings(value, pattern: re.Pattern) -> str | None:
    """The first match of ``pattern`` in any string (key or value) of a JSON-like value, else None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found = pattern.search(item)
            if found:
                return found.group(0)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _split_at(rendered: str, placeholders: list[str]) -> list[str] | None:
    """The template text around each placeholder ([before 1st, between 1st and 2nd, ..., after last]), or
    None when a placeholder is missing, repeated or out of order (the template transformed a content)."""
    pieces, pos = [], 0
    for placeholder in placeholders:
        at = rendered.find(placeholder, pos)
        if at < 0 or rendered.count(placeholder) != 1:
            return None
        pieces.append(rendered[pos:at])
        pos = at + len(placeholder)
    pieces.append(rendered[pos:])
    return pieces
