"""The in-band error each streamed route must end with when an answer fails after its first chunk (the failure
injected by ``tests/assets/inject_failure``): shared by the edges' tests (tests/test_edge_failures.py: `llm_api
serve` and TorchServe; tests/test_scale_out.py: Ray Serve's ingress)."""

from __future__ import annotations

import json

import httpx

MODEL = "smollm2"
PROMPT = "Write a long story about a lighthouse keeper."


def post_stream(server, path: str | None, body: dict, key: str) -> str:
    """POST to ``path`` below the server's OpenAI base (``/v1/...``), or to the native route (``None``)."""
    url = server.native_url if path is None else server.openai_base.removesuffix("/v1") + path
    answer = httpx.post(url, json=body, timeout=120, headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text  # (the stream began: a 200, and the error comes in-band)
    return answer.text


def sse(text: str) -> list[tuple[str | None, str]]:
    """The stream's events as (event name or None, data); every line must be SSE (no native line mixed in)."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, None
        for line in block.split("\n"):
            assert line.startswith(("event: ", "data: ", ":")), f"a line that is not SSE in {text!r}"
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = line.removeprefix("data: ")
        events.append((name, data))
    return events


def check_chat_and_completions(server, key: str, model: str = MODEL) -> None:
    """Each ends with an OpenAI error event, then ``[DONE]``."""
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
                       ("/v1/completions", {"prompt": PROMPT})):
        events = sse(post_stream(server, path, {"model": model, "max_tokens": 32, "stream": True, **body}, key))
        assert events[-1] == (None, "[DONE]") and len(events) >= 3, events
        error = json.loads(events[-2][1])
        assert error["error"]["code"] == "internal_error" and error["error"]["type"] == "server_error", events


def check_responses(server, key: str, model: str = MODEL) -> None:
    """Ends with ``error`` and ``response.failed``."""
    events = sse(post_stream(server, "/v1/responses", {"model": model, "input": PROMPT, "max_output_tokens": 32,
                                                        "stream": True}, key))
    assert [name for name, _ in events][-2:] == ["error", "response.failed"], events
    assert json.loads(events[-1][1])["response"]["status"] == "failed"


def check_messages(server, key: str, model: str = MODEL) -> None:
    """Ends with Anthropic's ``error`` event."""
    events = sse(post_stream(server, "/v1/messages", {"model": model, "max_tokens": 32, "stream": True,
                                                       "messages": [{"role": "user", "content": PROMPT}]}, key))
    assert events[0][0] == "message_start" and events[-1][0] == "error", events
    assert json.loads(events[-1][1])["error"]["type"] == "api_error"


def check_native(server, key: str) -> None:
    """The native stream ends with its JSON error line."""
    text = post_stream(server, None, {"text": "The capital of France is", "stream": True, "max_new_tokens": 24,
                                      "ignore_eos": True}, key)
    head, _, last = text.rpartition("\n")
    assert head and json.loads(last)["type"] == "internal_error", text
