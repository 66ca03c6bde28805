"""Logprobs, n > 1, penalties and logit bias against real TorchServes: the openai package on the OpenAI
routes, the native route over HTTP and gRPC (``"output": "jsonl"``), and the generate() reference."""

import json
import math

import pytest

from llm_api.client import GRPCClient, HTTPClient, RequestRefused, json_lines

pytestmark = pytest.mark.server
CHAT = [{"role": "user", "content": "Name three colours."}]
MARKER = "<|endoftext|>"


@pytest.fixture
def client(async_server):
    import openai

    return openai.OpenAI(base_url=f"{async_server.http}/predictions/smollm2/1.0/v1", api_key=async_server.key(),
                         max_retries=0)


def check_chat_logprobs(content: str, entries, num_top: int, greedy: bool):
    """The entries are log-probabilities of exactly the returned tokens."""
    # (A choice cut by max_tokens may end inside a character: its last token's bytes are not text yet.)
    assert b"".join(bytes(e.bytes) for e in entries).decode(errors="ignore") == content
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == num_top
        top = [t.logprob for t in e.top_logprobs]
        assert top == sorted(top, reverse=True) and sum(math.exp(v) for v in top) <= 1 + 1e-4
        assert e.logprob <= top[0] + 1e-5
        same = [t.logprob for t in e.top_logprobs if t.token == e.token]
        assert not same or same[0] == pytest.approx(e.logprob, abs=1e-5)
        if greedy:  # the greedy token is the most likely one (tokens tied with it may be listed in either order)
            assert e.logprob == pytest.approx(top[0], abs=1e-5)
            assert e.token in [t.token for t in e.top_logprobs if t.logprob == pytest.approx(top[0], abs=1e-5)]


def test_chat_logprobs_streamed_and_whole(client):
    whole = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=20, temperature=0, logprobs=True,
                                           top_logprobs=5)
    choice = whole.choices[0]
    check_chat_logprobs(choice.message.content, choice.logprobs.content, 5, greedy=True)
    chunks = list(client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=20, temperature=0,
                                                 logprobs=True, top_logprobs=5, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    # (The second call reads the prompt from the prefix cache: the same numbers up to float rounding, which the
    # embedded model's quantized inputs can turn into ~1e-3 of a logprob: docs/model-options.md.)
    assert [e.token for e in streamed] == [e.token for e in choice.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in choice.logprobs.content], abs=5e-3)
    # Each chunk carries the logprobs of the text it brings.
    for c in chunks:
        if c.choices and c.choices[0].delta.content:
            assert b"".join(bytes(e.bytes) for e in c.choices[0].logprobs.content).decode() == c.choices[0].delta.content
    # Sampled tokens: the logprob is the token's own, in the tempered distribution it was drawn from.
    sampled = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=16, temperature=0.8, seed=3,
                                             logprobs=True, top_logprobs=3)
    check_chat_logprobs(sampled.choices[0].message.content, sampled.choices[0].logprobs.content, 3, greedy=False)


def test_completion_logprobs(client):
    prompt = "The capital of France is"
    whole = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    lp = whole.choices[0].logprobs
    assert "".join(lp.tokens) == whole.choices[0].text and len(lp.tokens) == whole.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))
    events = list(client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0, logprobs=3,
                                            stream=True))
    tokens = [t for e in events if e.choices and e.choices[0].logprobs for t in e.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_n_choices(client):
    answer = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=24, temperature=1.0, seed=5, n=2)
    assert [c.index for c in answer.choices] == [0, 1]
    first, second = (c.message.content for c in answer.choices)
    assert first and second and first != second
    assert all(c.finish_reason in ("stop", "length") for c in answer.choices)
    # Choice 0 is what n = 1 gives with the same seed; a second call gives the same choices.
    single = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=24, temperature=1.0, seed=5)
    assert single.choices[0].message.content == first
    assert answer.usage.completion_tokens > single.usage.completion_tokens
    chunks = list(client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                            seed=8, n=3, stream=True, stream_options={"include_usage": True}))
    texts, reasons = {0: "", 1: "", 2: ""}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    assert set(reasons) == {0, 1, 2} and len(set(texts.values())) == 3
    whole = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=8,
                                      n=3)
    assert [c.text for c in whole.choices] == [texts[i] for i in range(3)]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_penalties_and_logit_bias_change_the_output(client, async_server, embedded_checkpoint_path):
    from transformers import AutoTokenizer

    prompt = "Repeat the word 'hello' twenty times: hello hello hello"

    def complete(**kw):
        return client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0, logprobs=0,
                                         **kw).choices[0]

    plain = complete()
    assert plain.text.count("hello") >= 3
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        assert complete(**penalty).text.count("hello") < plain.text.count("hello"), penalty
    # The greedy first token's id, from the native route (its logprobs carry ids), banned by a -100 bias.
    http = HTTPClient(async_server.http, "smollm2", async_server.key())
    lines = list(json_lines(http.stream({"text": prompt, "max_new_tokens": 1, "logprobs": 0, "output": "jsonl"})))
    first = lines[0]["logprobs"][0]
    assert first["token"] == plain.logprobs.tokens[0]
    assert complete(logit_bias={str(first["token_id"]): -100}).logprobs.tokens[0] != first["token"]
    zebra = AutoTokenizer.from_pretrained(embedded_checkpoint_path).encode(" zebra")[0]
    boosted = complete(logit_bias={str(zebra): 100})
    assert boosted.logprobs.tokens[0] == AutoTokenizer.from_pretrained(embedded_checkpoint_path).decode([zebra])


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 0}, "n"), ({"n": 65}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"), ({"logit_bias": {"1": 150}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"seed": -5}, "seed"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_bad_values_are_a_400_naming_the_field(client, kwargs, param):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4, **kwargs)
    assert err.value.status_code == 400 and err.value.body["param"] == param


def test_completion_logprobs_above_5_is_a_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smollm2", prompt="x", max_tokens=2, logprobs=6)
    assert err.value.body["param"] == "logprobs"


def native_lines(lines):
    choices, usage = {}, None
    for line in lines:
        if "usage" in line:
            usage = line["usage"]
            continue
        choice = choices.setdefault(line["index"], {"text": "", "logprobs": [], "finish_reason": None})
        if "finish_reason" in line:
            choice["finish_reason"] = line["finish_reason"]
            choice["completion_tokens"] = line["completion_tokens"]
        else:
            choice["text"] += line["text"]
            choice["logprobs"] += line.get("logprobs", [])
    return choices, usage


NATIVE = {"text": "Once upon a time", "max_new_tokens": 12, "temperature": 1.0, "seed": 4, "n": 2, "logprobs": 2,
          "output": "jsonl"}


def check_native_choices(choices, usage, n=2):
    assert sorted(choices) == list(range(n)) and choices[0]["text"] != choices[1]["text"]
    for choice in choices.values():
        assert choice["finish_reason"] in ("stop", "length") and len(choice["logprobs"]) <= choice["completion_tokens"]
        assert "".join(e["token"] for e in choice["logprobs"]) == choice["text"]
        assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 and isinstance(e["token_id"], int)
                   for e in choice["logprobs"])
    assert usage["completion_tokens"] == sum(c["completion_tokens"] for c in choices.values())


def test_native_route_http_and_grpc(async_server):
    http = HTTPClient(async_server.http, "smollm2", async_server.key())
    choices, usage = native_lines(json_lines(http.stream(NATIVE)))
    check_native_choices(choices, usage)
    # gRPC: the same request as form fields (strings), streamed and unary; the same seeded answer.
    fields = {k: json.dumps(v) if not isinstance(v, str) else v for k, v in NATIVE.items()}
    with GRPCClient(async_server.grpc, "smollm2", async_server.key()) as grpc_client:
        streamed, grpc_usage = native_lines(json_lines(grpc_client.stream(fields)))
        unary, _ = native_lines(json_lines([grpc_client.generate(fields)]))
        with pytest.raises(RequestRefused) as err:
            grpc_client.generate({"text": "x", "n": "2"})
        assert "'n' needs" in err.value.error["message"]
    assert streamed == choices == unary and grpc_usage == usage
    # Penalties and bias on the plain text output: the marker-terminated stream is unchanged.
    text = http.generate({"text": "hello hello hello", "max_new_tokens": 6, "presence_penalty": 1.5,
                          "logit_bias": {"0": -100}})
    assert text and MARKER not in text
    with pytest.raises(RequestRefused) as err:
        http.generate({"text": "x", "logit_bias": {"999999": 1}})
    assert err.value.status == 400 and "999999" in err.value.error["message"]


def test_native_stop_string_ends_one_choice(async_server):
    http = HTTPClient(async_server.http, "smollm2", async_server.key())
    body = {**NATIVE, "n": 3, "stop": [" "], "max_new_tokens": 20, "logprobs": 0}
    choices, usage = native_lines(json_lines(http.stream(body)))
    assert all(" " not in c["text"] for c in choices.values())
    assert usage["completion_tokens"] < 3 * 20


def test_generate_reference_core_serves_n_and_logprobs(batch4_server):
    http = HTTPClient(batch4_server.http, "smollm2", batch4_server.key())
    choices, usage = native_lines(json_lines(http.stream(NATIVE)))
    check_native_choices(choices, usage)


def test_a_deadline_ends_every_choice(async_server):
    from llm_api.client import StreamError

    http = HTTPClient(async_server.http, "smollm2", async_server.key())
    lines = []
    with pytest.raises(StreamError, match="deadline"):
        for line in json_lines(http.stream({**NATIVE, "n": 3, "max_new_tokens": 1000, "ignore_eos": True, "timeout": 10})):
            lines.append(line)
    assert {line["index"] for line in lines} == {0, 1, 2} and not any("finish_reason" in line for line in lines)
    assert async_server.worker_status() == "READY"
    stats = json.loads(urllib_get(f"{async_server.http}/predictions/smollm2/1.0/v1/health", async_server.key()))
    assert stats["num_active_requests"] == 0


def urllib_get(url, key):
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"}), timeout=30) as r:
        return r.read()
