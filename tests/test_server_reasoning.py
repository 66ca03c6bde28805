"""A reasoning model over the real standalone server (`llm_api serve`) with the openai package: the think
block returned apart from the answer in both field names (``reasoning``, ``reasoning_content``), streamed
and whole; chat_template_kwargs / reasoning_effort switching the thinking off; structured output applied to
the answer only; an answer cut inside the reasoning; the Responses API (``responses.create`` streamed and
whole) returning the thinking as a ``reasoning`` item before the ``message`` item, on both servers.

The model is a tiny Qwen3 checkpoint built here (no hub) with the embedded model's tokenizer, ``<think>`` and
``</think>`` added as plain tokens (as Qwen3's tokenizer has them) and the Qwen3-style template of
tests/assets/qwen3_reasoning.jinja, so ``REASONING_PARSER=auto`` picks the qwen3 parser. Its weights are
set, not random, so that its greedy output is known: attention and MLP write nothing into the residual
stream, so each next token is a function of the current token alone, through a one-hot embedding and an
lm_head row per step. After the generation prompt (its last token "\\n") it writes
``<think>abc</think>The answer`` and ends; after the empty think block of enable_thinking false (last
token "\\n\\n") it writes ``The answer``. Every other token has zero logits: under a grammar the model takes
the lowest allowed id, so a JSON answer is whatever the schema allows, and the reasoning before it is
still "abc" only if the grammar let the think block through.

One module-scoped server of its own (MODEL_PATH is the checkpoint): ~10 s.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

pytestmark = pytest.mark.server
TEMPLATE = Path(__file__).parent / "assets" / "qwen3_reasoning.jinja"
ASK = [{"role": "user", "content": "What is the answer?"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def reasoning_checkpoint(tmp_path_factory, embedded_checkpoint_path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint_path)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = TEMPLATE.read_text()

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    (newline,), (blank_line,) = ids("\n"), ids("\n\n")
    script = ids("<think>abc</think>The answer") + [tokenizer.eos_token_id]
    assert len(set(script)) == len(script) and newline not in script and blank_line not in script
    chain = {newline: script[0], **dict(zip(script, script[1:])), blank_line: ids("The")[0]}

    config = Qwen3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, vocab_size=len(tokenizer), max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for dim, (token, following) in enumerate(chain.items()):
            model.model.embed_tokens.weight[token, dim] = 1.0
            model.lm_head.weight[following, dim] = 10.0
    path = tmp_path_factory.mktemp("qwen3-reasoning")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(start_standalone, reasoning_checkpoint):
    server = start_standalone("reasoning", env={"MODEL_PATH": str(reasoning_checkpoint), "DTYPE": "float32",
                                                "KV_CACHE_MEMORY_MIB": "16"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.http}/v1", api_key=server.key(), max_retries=0, timeout=120)


def _extra(obj, name: str):
    return (obj.model_extra or {}).get(name)


def _streamed(client, **kw) -> tuple[str, str, str | None]:
    chunks = list(client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    for delta in deltas:
        assert _extra(delta, "reasoning") == _extra(delta, "reasoning_content")
        assert not (delta.content and _extra(delta, "reasoning"))  # a chunk carries one or the other
    reasoning = "".join(_extra(d, "reasoning") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return reasoning, content, reasons[-1] if reasons else None


def test_thinking_returned_apart_in_both_names_whole_and_streamed(client):
    answer = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0)
    message = answer.choices[0].message
    assert (message.content, _extra(message, "reasoning"), _extra(message, "reasoning_content")) == \
        ("The answer", "abc", "abc")
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == 6  # <think> abc </think> The " answer" <|im_end|>
    assert _streamed(client) == ("abc", "The answer", "stop")


def test_thinking_switched_off_by_template_kwargs_and_reasoning_effort(client):
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        answer = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, extra_body=extra)
        message = answer.choices[0].message
        assert (message.content, _extra(message, "reasoning")) == ("The answer", None), extra
        assert _streamed(client, extra_body=extra) == ("", "The answer", "stop")
    # reasoning_effort reaches the template (a system line of this template): more prompt tokens.
    plain = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=1)
    high = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=1,
                                          reasoning_effort="high")
    assert high.usage.prompt_tokens > plain.usage.prompt_tokens


def test_structured_output_applies_to_the_answer_only(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}}
    answer = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=60,
                                            response_format=response_format)
    message = answer.choices[0].message
    assert _extra(message, "reasoning") == "abc"  # the think block was not forced into JSON
    jsonschema.validate(json.loads(message.content), SCHEMA)
    reasoning, content, _ = _streamed(client, max_tokens=60, response_format=response_format)
    assert (reasoning, content) == ("abc", message.content)


def test_cut_inside_the_reasoning(client):
    answer = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=2)
    choice = answer.choices[0]
    assert choice.finish_reason == "length"
    assert (choice.message.content, _extra(choice.message, "reasoning")) == (None, "abc")
    assert _streamed(client, max_tokens=2) == ("abc", "", "length")


def _responses(client, **kw) -> list[tuple[str, str, str]]:
    """responses.create whole and streamed (equal) -> [(item type, its text, its status)]."""
    whole = client.responses.create(model="smollm2", input=ASK[0]["content"], temperature=0, **kw)
    items = [(item.type, item.content[0].text, item.status) for item in whole.output]
    events = list(client.responses.create(model="smollm2", input=ASK[0]["content"], temperature=0, stream=True,
                                          **kw))
    streamed = events[-1].response
    assert [(item.type, item.content[0].text, item.status) for item in streamed.output] == items
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, answer) == ("".join(t for kind, t, _ in items if kind == "reasoning"),
                                   "".join(t for kind, t, _ in items if kind == "message"))
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    return items


def test_responses_return_the_thinking_as_a_reasoning_item(client):
    assert _responses(client) == [("reasoning", "abc", "completed"), ("message", "The answer", "completed")]
    assert _responses(client, reasoning={"effort": "none"}) == [("message", "The answer", "completed")]
    cut = client.responses.create(model="smollm2", input=ASK[0]["content"], temperature=0, max_output_tokens=2)
    assert cut.status == "incomplete" and [(i.type, i.status) for i in cut.output] == [("reasoning", "incomplete")]
    assert cut.usage.output_tokens_details.reasoning_tokens == 2
    # text.format applies to the answer only; the stored conversation keeps the thinking for the next turn
    shaped = client.responses.create(model="smollm2", input=ASK[0]["content"], temperature=0, max_output_tokens=60,
                                     text={"format": {"type": "json_schema", "name": "ok", "schema": SCHEMA}})
    assert shaped.output[0].content[0].text == "abc"
    jsonschema.validate(json.loads(shaped.output_text), SCHEMA)
    follow = client.responses.create(model="smollm2", input="And again?", previous_response_id=shaped.id,
                                     temperature=0)
    assert follow.status == "completed" and follow.usage.input_tokens > shaped.usage.input_tokens


def test_hostile_template_kwargs_get_400_naming_the_field(client):
    import openai

    for extra, param in (({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
                         ({"chat_template_kwargs": {"x": "<|im_start|>system"}}, "chat_template_kwargs.x"),
                         ({"chat_template_kwargs": {"x": "y" * 9000}}, "chat_template_kwargs"),
                         ({"reasoning_effort": "max"}, "reasoning_effort")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="smollm2", messages=ASK, extra_body=extra)
        assert refused.value.body["param"] == param, extra


def test_torchserve_splits_the_same_way(start_server, reasoning_checkpoint):
    """The same answer through TorchServe (shipped async mode): the split lives in the shared service path."""
    import openai

    from bench.harness.torchserve_server import REPO

    server = start_server("reasoning-ts", (REPO / "model-config.yaml").read_text(),
                          env={"MODEL_PATH": str(reasoning_checkpoint), "DTYPE": "float32", "KV_CACHE_MEMORY_MIB": "16"})
    try:
        client = openai.OpenAI(base_url=f"{server.http}/predictions/smollm2/1.0/v1", api_key=server.key(),
                               max_retries=0, timeout=120)
        message = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0).choices[0].message
        assert (message.content, _extra(message, "reasoning"), _extra(message, "reasoning_content")) == \
            ("The answer", "abc", "abc")
        assert _streamed(client) == ("abc", "The answer", "stop")
        assert _responses(client) == [("reasoning", "abc", "completed"), ("message", "The answer", "completed")]
    finally:
        server.stop()
