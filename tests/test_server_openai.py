"""The OpenAI-compatible API, the metrics and the readiness path against both front ends: TorchServe in the
shipped async mode (routes below /predictions/<model>/1.0/v1) and `llm_api serve` (routes at /v1)."""

import asyncio
import json
import re
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.server
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture()
def base_url(async_frontend):
    return async_frontend.openai_base


def call(async_server, path, body=None, method=None):
    """``path`` below the OpenAI base (``chat/completions``), or an absolute URL."""
    url = path if path.startswith("http") else f"{async_server.openai_base}/{path}"
    req = urllib.request.Request(
        url, data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {async_server.key()}", "Content-Type": "application/json"}, method=method,
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.headers, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read().decode()


def test_openai_client_streams_a_chat_answer_and_raises_bad_request(async_frontend, base_url):
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=async_frontend.key(), max_retries=0)
    stream = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=24, temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text and len(chunks) > 3
    assert chunks[-1].choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=CHAT, temperature=5)
    assert err.value.body["param"] == "temperature" and err.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="MAX_NUM_SEQS"):
        client.chat.completions.create(model="smollm2", messages=CHAT, n=65)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    assert async_frontend.worker_status() == "READY"


def test_openai_async_client_usage_stop_seed_and_finish_reasons(async_frontend, base_url):
    import openai

    async def main():
        client = openai.AsyncOpenAI(base_url=base_url, api_key=async_frontend.key(), max_retries=0)
        chat = await client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=24, temperature=0)
        short = await client.completions.create(model="smollm2", prompt="One, two, three,", max_tokens=3, temperature=0)
        stopped = await client.completions.create(model="smollm2", prompt="One, two, three,", max_tokens=20, temperature=0, stop=[","])
        seeded = [await client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8, seed=7, temperature=1.0)
                  for _ in range(2)]
        events = [e async for e in await client.completions.create(
            model="smollm2", prompt="Hello", max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True})]
        models = await client.models.list()
        return chat, short, stopped, seeded, events, models

    chat, short, stopped, seeded, events, models = asyncio.run(main())
    assert "Paris" in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"
    assert chat.usage.prompt_tokens > 5 and chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    assert stopped.choices[0].finish_reason == "stop" and "," not in stopped.choices[0].text
    assert seeded[0].choices[0].text == seeded[1].choices[0].text
    assert events[-1].usage.completion_tokens == 5 and events[-1].choices == []
    assert [m.id for m in models.data] == ["smollm2"]


def test_sse_wire_format_and_errors(async_frontend):
    status, headers, body = call(async_frontend, "chat/completions", {"model": "smollm2", "messages": CHAT, "max_tokens": 4, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    blocks = [b for b in body.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks) and blocks[-1] == "data: [DONE]"
    status, headers, body = call(async_frontend, "completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert json.loads(body)["object"] == "text_completion"
    for path, payload, code in (("chat/completions", {"model": "smollm2", "messages": CHAT, "top_p": 2}, 400),
                                ("completions", {"model": "smollm2"}, 400),
                                ("nothing", {}, 404)):
        status, headers, body = call(async_frontend, path, payload)
        assert status == code and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def test_health_is_ready_while_tokens_flow(async_frontend):
    status, _, body = call(async_frontend, async_frontend.ready_url)
    assert status == 200 and json.loads(body)["ready"] is True
    long = {"text": "Write a long story.", "max_new_tokens": 200, "ignore_eos": True}
    req = urllib.request.Request(f"{async_frontend.http}/predictions/smollm2", data=json.dumps(long).encode(),
                                 headers={"Authorization": f"Bearer {async_frontend.key()}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read1(1)
        status, _, body = call(async_frontend, async_frontend.ready_url)
        health = json.loads(body)
        resp.read()
    assert status == 200 and health["status"] == "ok" and health["num_active_requests"] >= 1
    assert health["tokens_per_second"] > 0


def scrape(async_frontend) -> dict[str, float]:
    text = async_frontend.metrics_text()
    values = {}
    for line in text.splitlines():
        m = re.match(r"^(llm_\w+?)(\{[^}]*\})? ([-+0-9.eE]+|NaN)$", line)
        if m:
            key = m.group(1) + ("" if "le=" not in (m.group(2) or "") else "{" + re.search(r'le="([^"]+)"', m.group(2)).group(1) + "}")
            values[key] = values.get(key, 0.0) + float(m.group(3))
    return values


def test_metrics_endpoint_shows_each_metric(async_frontend):
    from llm_api.client import HTTPClient
    from llm_api.service.metrics import METRICS

    http = HTTPClient(async_frontend.http, "smollm2", async_frontend.key())
    system = "You are a helpful assistant who answers in one short sentence. " * 4
    histograms = [name for name, (kind, _, _) in METRICS.items() if kind == "histogram"]
    before = scrape(async_frontend)  # the server is shared: count what these two requests add
    for question in ("What is the capital of France?", "What is the capital of Spain?"):
        http.generate({"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}], "max_new_tokens": 16})

    def grown(values):
        return (all(values.get(f"{name}_count", 0) >= before.get(f"{name}_count", 0) + 2 for name in histograms)
                and values.get("llm_prefix_cache_hits_total", 0) > before.get("llm_prefix_cache_hits_total", 0))

    # TorchServe takes the worker's metric lines from its log, which may trail the answers by a moment.
    deadline = time.monotonic() + 15
    while not grown(values := scrape(async_frontend)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for name, (kind, _, _) in METRICS.items():
        if kind == "histogram":
            assert values.get(f"{name}_count", 0) >= before.get(f"{name}_count", 0) + 2, name
            assert values[f"{name}_sum"] > 0 and f"{name}_bucket{{+Inf}}" in values, name
        else:
            assert name in values, name
    assert values["llm_time_to_first_token_seconds_sum"] / values["llm_time_to_first_token_seconds_count"] < 30
    assert 0 < values["llm_inter_token_latency_seconds_sum"] / values["llm_inter_token_latency_seconds_count"] < 5
    assert values["llm_prompt_tokens_total"] >= 100 and values["llm_generation_tokens_total"] >= 16
    assert values["llm_prefix_cache_hits_total"] > before.get("llm_prefix_cache_hits_total", 0)
    assert 0 < values["llm_prefix_cache_hit_rate"] <= 1
    assert values["llm_num_requests_running"] >= 0 and values["llm_num_requests_waiting"] >= 0
    assert 0 <= values["llm_kv_cache_usage_ratio"] <= 1 and values["llm_num_preemptions_total"] >= 0


def test_tokenize_and_detokenize(async_frontend):
    """vLLM's tokenizer routes: at /tokenize and /detokenize on `llm_api serve`, below the model
    (/predictions/<model>/1.0/tokenize) on TorchServe."""
    base = async_frontend.openai_base.rsplit("/v1", 1)[0]
    status, _, body = call(async_frontend, f"{base}/tokenize", {"prompt": "The capital of France is"})
    answer = json.loads(body)
    assert status == 200 and answer["count"] == len(answer["tokens"]) > 3 and answer["max_model_len"] > 1000
    status, _, body = call(async_frontend, f"{base}/detokenize", {"tokens": answer["tokens"]})
    assert status == 200 and json.loads(body) == {"prompt": "The capital of France is"}
    # Chat messages tokenize exactly as a chat call's prompt (its usage counts them).
    _, _, body = call(async_frontend, f"{base}/tokenize", {"model": "smollm2", "messages": CHAT})
    _, _, completion = call(async_frontend, "chat/completions", {"model": "smollm2", "messages": CHAT, "max_tokens": 2})
    assert json.loads(body)["count"] == json.loads(completion)["usage"]["prompt_tokens"]
    for path, payload, code in (("tokenize", {"prompt": "a", "messages": CHAT}, 400), ("tokenize", {}, 400),
                                ("tokenize", {"prompt": "a", "model": "gpt-4"}, 404),
                                ("tokenize", {"prompt": "a", "extra": 1}, 400),
                                ("detokenize", {"tokens": [-1]}, 400), ("detokenize", {"tokens": [10**9]}, 400),
                                ("detokenize", {"tokens": ["a"]}, 400), ("detokenize", {"tokens": [True]}, 400),
                                ("detokenize", {"tokens": "\u00e9\r\n<|endoftext|>"}, 400)):
        status, _, body = call(async_frontend, f"{base}/{path}", payload)
        assert status == code and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}, (path, payload)


def test_ignore_eos_runs_every_openai_route_to_its_token_limit(async_frontend, base_url):
    """vLLM's ``ignore_eos`` as benchmark clients send it (``extra_body``): without it the short answer ends
    at EOS (``stop``), with it the answer runs to the limit (``length``) on chat, streamed chat, completions
    and the Responses API; a non-boolean value, or a grammar beside it, is a 400 naming it."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=async_frontend.key(), max_retries=0)
    flag = {"ignore_eos": True}
    free = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=40, temperature=0)
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens < 40
    held = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=40, temperature=0, extra_body=flag)
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("length", 40)
    chunks = list(client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}, extra_body=flag))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 40
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    free = client.completions.create(model="smollm2", prompt=prompt, max_tokens=40, temperature=0)
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens < 40
    held = client.completions.create(model="smollm2", prompt=prompt, max_tokens=40, temperature=0, extra_body=flag)
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("length", 40)
    answer = client.responses.create(model="smollm2", input=CHAT[0]["content"], max_output_tokens=40, temperature=0,
                                     extra_body=flag)
    assert answer.status == "incomplete" and answer.usage.output_tokens == 40

    routes = ((client.chat.completions.create, {"messages": CHAT, "max_tokens": 4}),
              (client.completions.create, {"prompt": "Hi", "max_tokens": 4}),
              (client.responses.create, {"input": "Hi", "max_output_tokens": 4}))
    for value in ("true", 1, None, [True]):
        for create, fields in routes:
            with pytest.raises(openai.BadRequestError) as err:
                create(model="smollm2", **fields, extra_body={"ignore_eos": value})
            assert err.value.body["param"] == "ignore_eos" and err.value.body["code"] == "invalid_type", err.value.body
    with pytest.raises(openai.BadRequestError, match="response_format") as err:
        client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4, extra_body=flag,
                                       response_format={"type": "json_object"})
    assert err.value.body["param"] == "ignore_eos"
    with pytest.raises(openai.BadRequestError, match="text.format") as err:
        client.responses.create(model="smollm2", input="Hi", max_output_tokens=4, extra_body=flag,
                                text={"format": {"type": "json_object"}})
    assert err.value.body["param"] == "ignore_eos"
    assert async_frontend.worker_status() == "READY"


def _forward_logprobs(lm, ids):
    """log_softmax of the in-process model's logits over ``ids``: row i scores token i + 1."""
    import torch

    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def test_completions_echo_scores_the_prompt_as_a_forward_pass_does(async_frontend, base_url, embedded_lm_fp32):
    """What evaluation harnesses send (lm-eval's loglikelihood: ``echo``, ``logprobs``, prompts as token-id
    lists, several prompts in one call, ``max_tokens`` 1 or 0): each prompt token's logprob and the top
    alternatives equal an in-process forward pass of the same float32 model (tie-aware: the top values must
    match, and each listed token must have its listed value); the first token's is null; prompt p's choice
    i is choice p * n + i."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=async_frontend.key(), max_retries=0)
    tokenizer = embedded_lm_fp32.tokenizer
    texts = ["The capital of France is Paris", "Water boils at one hundred degrees"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    answer = client.completions.create(model="smollm2", prompt=prompts, max_tokens=1, temperature=0, logprobs=2,
                                       echo=True, n=2)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert answer.usage.prompt_tokens == sum(len(p) for p in prompts)  # (a prompt's n choices share it)
    for choice in answer.choices:
        ids = prompts[choice.index // 2]
        reference = _forward_logprobs(embedded_lm_fp32, ids)
        logprobs = choice.logprobs
        assert choice.text.startswith(tokenizer.decode(ids))
        assert len(logprobs.token_logprobs) == len(ids) + 1  # the prompt's tokens and the sampled one
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.tokens[: len(ids)] == [tokenizer.decode([i]) for i in ids]
        for position in range(1, len(ids)):
            row = reference[position - 1]
            # (within 1e-2: the embedded model's products quantize their inputs, and the server's prefill (C
            # attention over the pool) and this forward (SDPA) differ in float32's last bits, which can move an
            # input value across a rounding boundary: ~1e-3 in a logprob; a wrong token's is off by far more)
            assert abs(logprobs.token_logprobs[position] - row[ids[position]].item()) < 1e-2
            top = logprobs.top_logprobs[position]
            expected = row.topk(2).values.tolist()
            listed = sorted(top.values(), reverse=True)
            assert len(top) in (2, 3)  # the two most likely and the prompt's own token when it is not one of them
            assert all(abs(a - b) < 1e-2 for a, b in zip(listed, expected))
    # max_tokens 0: the prompt alone, nothing generated.
    only = client.completions.create(model="smollm2", prompt=texts[0], max_tokens=0, echo=True, logprobs=0)
    assert only.choices[0].text == texts[0] and only.usage.completion_tokens == 0
    assert only.choices[0].finish_reason == "length" and len(only.choices[0].logprobs.tokens) == len(prompts[0])
    # Streamed, echo without logprobs: the prompt is the first text of the choice.
    chunks = list(client.completions.create(model="smollm2", prompt=texts[1], max_tokens=4, temperature=0, echo=True,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith(texts[1])
    for prompt, param in (([[]], "prompt[0]"), ([[-1]], "prompt[0]"), ([10**9], "prompt"), ([1.5], "prompt[0]"),
                          (["a", ""], "prompt[1]"), ([["a"]], "prompt[0]")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="smollm2", prompt=prompt, max_tokens=1)
        assert set(err.value.body) == {"message", "type", "param", "code"}
        assert param is None or err.value.body["param"] == param, (prompt, err.value.body)
    with pytest.raises(openai.BadRequestError, match="only with 'echo'"):
        client.completions.create(model="smollm2", prompt="a", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="MAX_NUM_SEQS"):
        client.completions.create(model="smollm2", prompt=["a"] * 40, n=2, max_tokens=1)


def test_tokenizer_info_as_vllm_serves_it(async_frontend):
    """``GET /tokenizer_info`` (lm-eval's remote tokenizer reads it) beside /tokenize, behind the key."""
    base = async_frontend.openai_base.rsplit("/v1", 1)[0]
    request = urllib.request.Request(f"{base}/tokenizer_info", headers={"Accept": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code in (400, 401)  # (TorchServe's token check answers a missing key with 400)
    status, _, body = call(async_frontend, f"{base}/tokenizer_info", method="GET")
    info = json.loads(body)
    assert status == 200 and info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    assert info["model_max_length"] > 1000 and info["tokenizer_class"]


def test_chat_fields_the_openai_package_sends(async_frontend, base_url):
    """store, metadata, service_tier, modalities and prediction through the openai package: served (nothing
    stored), the tier echoed."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=async_frontend.key(), max_retries=0)
    answer = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=8, temperature=0, store=True, metadata={"run": "ci"},
        service_tier="auto", modalities=["text"], prediction={"type": "content", "content": "Paris"})
    assert answer.choices[0].message.content and answer.service_tier == "auto"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=8, modalities=["text", "audio"])
    assert err.value.body["param"] == "modalities[1]"
