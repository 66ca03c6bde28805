"""HTTP against both front ends serving the embedded model: TorchServe (classic batching, .mar archive) and `llm_api serve`."""

import asyncio
import contextlib
import io
import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from llm_api.client import AsyncHTTPClient, HTTPClient, RequestRefused

pytestmark = pytest.mark.server
MARKER = "<|endoftext|>"
REPO = Path(__file__).resolve().parent.parent


def post_raw(server, body: bytes, content_type="application/json", key=True):
    headers = {"Content-Type": content_type}
    if key:
        headers["Authorization"] = f"Bearer {server.key()}"
    req = urllib.request.Request(f"{server.http}/predictions/{server.model_name}", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def reference_text(lm, prompt_ids, max_new_tokens):
    out = lm.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return lm.tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)


def test_greedy_text_equals_generate(frontend, embedded_lm_fp32):
    prompt = "The history of the Roman empire"
    client = HTTPClient(frontend.http, "smollm2", frontend.key())
    chunks = list(client.stream({"text": prompt, "max_new_tokens": 40}))
    ids = embedded_lm_fp32.tokenizer(prompt)["input_ids"]
    assert "".join(chunks) == reference_text(embedded_lm_fp32, ids, 40)
    assert len(chunks) > 5


def test_chunked_stream_ends_with_marker_only_once(frontend):
    status, headers, body = post_raw(frontend, json.dumps({"text": "List three colors:", "max_new_tokens": 30}).encode())
    assert status == 200 and headers.get("transfer-encoding", headers.get("Transfer-Encoding")) == "chunked"
    text = body.decode()
    assert text.endswith(MARKER) and text.count(MARKER) == 1


def test_messages_answer_paris(frontend):
    client = HTTPClient(frontend.http, "smollm2", frontend.key())
    answer = client.generate({"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_new_tokens": 32})
    assert "Paris" in answer


def test_form_fields(frontend):
    status, _, body = post_raw(frontend, b"text=The capital of France is&max_new_tokens=8", "application/x-www-form-urlencoded")
    assert status == 200 and body.decode().endswith(MARKER) and len(body) > len(MARKER)


def test_inputs_embeds_equal_text(frontend, embedded_lm_fp32):
    prompt = "Water boils at"
    ids = embedded_lm_fp32.tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        embeds = embedded_lm_fp32.model.get_input_embeddings()(torch.tensor(ids)).float().tolist()
    client = HTTPClient(frontend.http, "smollm2", frontend.key())
    from_embeds = client.generate({"inputs_embeds": embeds, "max_new_tokens": 16})
    from_text = client.generate({"text": prompt, "max_new_tokens": 16})
    assert from_embeds == from_text and from_text


def test_stop_string_ends_answer(frontend):
    client = HTTPClient(frontend.http, "smollm2", frontend.key())
    full = client.generate({"text": "1, 2, 3, 4, 5, 6,", "max_new_tokens": 20})
    assert " 8" in full
    cut = client.generate({"text": "1, 2, 3, 4, 5, 6,", "max_new_tokens": 20, "stop": [" 8"]})
    assert cut == full[: full.index(" 8")]


def test_readme_aiohttp_loop_unchanged(frontend):
    readme = (REPO / "README.md").read_text()
    code = re.search(r"<!-- readme-aiohttp-loop -->\n```python\n(.*?)```", readme, re.S).group(1)
    # Only the two lines that say where the server is change; the loop runs as written.
    code = re.sub(r'(?m)^URL = .*$', f'URL = "{frontend.http}/predictions/smollm2"', code)
    code = re.sub(r'(?m)^KEY = .*$', f'KEY = "{frontend.key()}"', code)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    printed = out.getvalue()
    assert printed.rstrip("\n").endswith(MARKER) and len(printed) > 64


def test_async_client_reads_chunks(frontend):
    client = AsyncHTTPClient(frontend.http, "smollm2", frontend.key())

    async def collect():
        return [t async for t in client.stream({"text": "Once upon a time", "max_new_tokens": 24})]

    chunks = asyncio.run(collect())
    assert len(chunks) > 3 and MARKER not in "".join(chunks)


LONG_PROMPT = "hello " * 2100
BAD_REQUESTS = {
    "empty body": b"",
    "truncated json": b'{"text": "hi"',
    "json array": b'["text"]',
    "invalid utf-8": b'{"text": "\xff"}',
    "two inputs": json.dumps({"text": "a", "messages": [{"role": "user", "content": "b"}]}).encode(),
    "missing input": json.dumps({"max_new_tokens": 3}).encode(),
    "text not a string": json.dumps({"text": ["a"]}).encode(),
    "negative temperature": json.dumps({"text": "a", "temperature": -1}).encode(),
    "non-numeric temperature": json.dumps({"text": "a", "temperature": "warm"}).encode(),
    "top_p zero": json.dumps({"text": "a", "top_p": 0}).encode(),
    "top_p above one": json.dumps({"text": "a", "top_p": 1.01}).encode(),
    "max_new_tokens zero": json.dumps({"text": "a", "max_new_tokens": 0}).encode(),
    "max_new_tokens over limit": json.dumps({"text": "a", "max_new_tokens": 2049}).encode(),
    "prompt over MAX_INPUT_TOKENS": json.dumps({"text": LONG_PROMPT}).encode(),
    "embeds wrong width": json.dumps({"inputs_embeds": [[0.0] * 10]}).encode(),
    "empty messages": json.dumps({"messages": []}).encode(),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_input_gets_json_4xx(frontend, name):
    status, headers, body = post_raw(frontend, BAD_REQUESTS[name])
    assert 400 <= status < 500, (status, body)
    error = json.loads(body)
    assert set(error) == {"code", "type", "message"} and error["code"] == status and error["message"]


def test_prompt_too_long_names_the_limit(frontend):
    _, _, body = post_raw(frontend, BAD_REQUESTS["prompt over MAX_INPUT_TOKENS"])
    assert "MAX_INPUT_TOKENS=2048" in json.loads(body)["message"]


def test_missing_key_is_refused(frontend):
    status, _, _ = post_raw(frontend, json.dumps({"text": "a"}).encode(), key=False)
    assert status in (400, 401)


def test_client_raises_refused_with_error_object(frontend):
    client = HTTPClient(frontend.http, "smollm2", frontend.key())
    with pytest.raises(RequestRefused) as err:
        client.generate({"text": "a", "top_k": -3})
    assert err.value.status == 400 and err.value.error["type"] == "invalid_parameter"


def test_deadline_in_classic_mode(frontend):
    status, _, body = post_raw(frontend, json.dumps(
        {"text": "Once upon a time", "max_new_tokens": 1000, "ignore_eos": True, "timeout": 1}).encode())
    text = body.decode()
    # A deadline that passes before the first token is the request's status (on a busy machine it may).
    assert status in (200, 408) and not text.endswith(MARKER)
    assert json.loads(text.strip().splitlines()[-1])["type"] == "timeout"
