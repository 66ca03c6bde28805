"""Priority scheduling (vLLM's ``priority`` request field, SCHEDULING_POLICY=priority): every API that takes a
body takes ``priority`` (an int32; lower first), refuses it unless the server serves priorities (anything but
0 then gets a 400 naming ``priority``), and a served priority reaches the engine: on a server that runs one
sequence at a time, a better-priority request preempts the running worse one and finishes first, and the
preempted answer, recomputed, is the same as alone. The scheduler's rules are in tests/engine/test_scheduler.py."""

from __future__ import annotations

import json
import threading
import time

import pytest

from bench.harness import hostile
from llm_api.errors import ApiError
from llm_api.protocols.chat.translate import parse_chat
from llm_api.protocols.completions.translate import parse_completions
from llm_api.protocols.native.translate import parse_request
from llm_api.protocols.responses.translate import parse_responses
from llm_api.service.request import Limits

FCFS = Limits(max_input_tokens=2048, max_new_tokens=2048, hidden_size=576, vocab_size=49152, max_n=64)
PRIORITY = Limits(max_input_tokens=2048, max_new_tokens=2048, hidden_size=576, vocab_size=49152, max_n=64,
                  priority_scheduling=True)


def _parse(api: str, priority, limits: Limits):
    extra = {} if priority is None else {"priority": priority}
    if api == "chat":
        return parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}, "m", limits)[0]
    if api == "completions":
        return parse_completions({"model": "m", "prompt": ["a", "b"], **extra}, "m", limits)[0]
    if api == "responses":
        return parse_responses({"model": "m", "input": "hi", **extra}, "m", limits)[0]
    return parse_request({"body": json.dumps({"text": "hi", **extra}).encode()}, limits)


@pytest.mark.parametrize("api", ["chat", "completions", "responses", "native"])
def test_every_api_takes_priority_only_when_the_server_serves_it(api):
    def priorities(request):
        return [r.priority for r in request] if isinstance(request, list) else request.priority

    assert priorities(_parse(api, None, FCFS)) in (0, [0, 0]) and priorities(_parse(api, 0, FCFS)) in (0, [0, 0])
    assert priorities(_parse(api, -7, PRIORITY)) in (-7, [-7, -7])
    with pytest.raises(ApiError) as refused:
        _parse(api, 3, FCFS)
    assert refused.value.status == 400 and refused.value.param == "priority"
    assert "SCHEDULING_POLICY" in refused.value.message
    assert refused.value.code == ("invalid_parameter" if api == "native" else "unsupported_value")
    for bad in (2**31, -(2**31) - 1, 1.5, True):
        with pytest.raises(ApiError) as refused:
            _parse(api, bad, PRIORITY)
        assert refused.value.status == 400 and refused.value.param == "priority", (bad, refused.value)
    if api != "native":  # (the native API takes form values, so numbers as text too)
        with pytest.raises(ApiError) as refused:
            _parse(api, "1", PRIORITY)
        assert refused.value.param == "priority"


@pytest.mark.server
def test_a_better_priority_preempts_and_finishes_first(start_standalone):
    server = start_standalone("priority", {"SCHEDULING_POLICY": "priority", "MAX_NUM_SEQS": "1", "DTYPE": "float32"})
    try:
        path = hostile.openai_path(server, "completions")
        low = {"model": server.model_name, "prompt": "Once upon a time", "max_tokens": 96, "temperature": 0,
               "ignore_eos": True, "priority": 5}
        alone = hostile.post_json(server, path, low)
        assert alone.status == 200, alone.body
        finished: dict[str, tuple[float, hostile.Answer]] = {}

        def send(name: str, body: dict) -> None:
            answer = hostile.post_json(server, path, body)
            finished[name] = (time.monotonic(), answer)

        background = threading.Thread(target=send, args=("low", low))
        background.start()
        time.sleep(1.0)  # (the low-priority answer is decoding: MAX_NUM_SEQS=1, it holds the only slot)
        send("high", {"model": server.model_name, "prompt": "The capital of France is", "max_tokens": 4,
                      "temperature": 0, "priority": -1})
        background.join(300)
        (high_at, high), (low_at, low_answer) = finished["high"], finished["low"]
        assert high.status == 200 and low_answer.status == 200, (high.body, low_answer.body)
        assert high_at < low_at, "the better priority did not finish first"
        # preempted and recomputed, the low-priority answer is the one it gets alone (greedy, float32)
        assert low_answer.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
        metrics = server.metrics_text()
        preemptions = [line for line in metrics.splitlines() if line.startswith("vllm:num_preemptions_total")]
        assert preemptions and float(preemptions[0].split()[-1]) >= 1, preemptions
    finally:
        server.stop()
