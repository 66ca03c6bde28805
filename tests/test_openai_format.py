"""OpenAI request translation and response encoding, without a server."""

import json

import pytest

from llm_api.engine.request import FinishReason
from llm_api.errors import ApiError
from llm_api.protocols.chat.translate import parse_chat
from llm_api.protocols.common.openai import models_list
from llm_api.protocols.common.openai_call import OpenAICall
from llm_api.protocols.completions.translate import parse_completions
from llm_api.service.request import Limits

LIMITS = Limits(max_input_tokens=2048, max_new_tokens=2048, hidden_size=576, vocab_size=49152, max_n=64)


def parse_call(kind, body, model_name, limits):
    """A chat call, or a completions call of one prompt: its request and encoder."""
    if kind == "chat":
        return parse_chat(body, model_name, limits)
    requests, call = parse_completions(body, model_name, limits)
    if len(requests) != 1:
        raise ApiError(400, "invalid_value", "this test takes one prompt", "prompt")
    return requests[0], call


def parse(kind, body):
    return parse_call(kind, json.dumps(body).encode(), "smollm2", LIMITS)


def test_chat_translation():
    req, call = parse("chat", {"model": "smollm2", "messages": [{"role": "developer", "content": "Be brief."},
                                                                {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                               "max_tokens": 7, "temperature": 0, "seed": 3, "stop": ["\n"], "n": 1})
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    p = req.params
    assert (p.max_new_tokens, p.do_sample, p.seed, p.stop) == (7, False, 3, ("\n",))
    assert call.kind == "chat" and not call.stream


def test_completion_defaults_follow_openai():
    req, call = parse("completions", {"model": "smollm2", "prompt": ["Once"], "stream": True,
                                      "stream_options": {"include_usage": True}})
    assert req.text == "Once" and req.params.max_new_tokens == 16
    assert req.params.do_sample and req.params.temperature == 1.0
    assert call.stream and call.include_usage


@pytest.mark.parametrize("body, param, status", [
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "n": 65}, "n", 400),  # > MAX_NUM_SEQS
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": -2.5}, "frequency_penalty", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"50000": 1}}, "logit_bias", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}, "logit_bias", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"05": 1}}, "logit_bias", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "logit_bias": [1]}, "logit_bias", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "seed": -1}, "seed", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, "presence_penalty", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "best_of": 2}, "best_of", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, "frobnicate", 400),
    ({"model": "smollm2", "messages": [{"role": "tool", "content": "x"}]}, "messages[0]", 400),  # no tool_call_id
    ({"model": "smollm2", "messages": [{"role": "function", "content": "x"}]}, "messages[0].role", 400),
    ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, "model", 404),
    ({"messages": [{"role": "user", "content": "x"}]}, "model", 400),
    ({"model": "smollm2", "messages": []}, "messages", 400),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens", 400),
])
def test_errors_name_the_parameter(body, param, status):
    with pytest.raises(ApiError) as err:
        parse("chat", body)
    assert err.value.param == param and err.value.status == status
    shape = err.value.openai_json()["error"]
    assert set(shape) == {"message", "type", "param", "code"} and shape["type"] == "invalid_request_error"


def test_bad_json():
    with pytest.raises(ApiError):
        parse_chat(b"{nope", "smollm2", LIMITS)
    with pytest.raises(ApiError):
        parse_chat(b"[1]", "smollm2", LIMITS)


def events(text):
    assert text.endswith("\n\n")
    return [block[len("data: "):] for block in text.split("\n\n") if block]


def test_chat_stream_encoding():
    call = OpenAICall("chat", "smollm2", stream=True, include_usage=True)
    out = call.delta("Hel") + call.delta("") + call.delta("lo") + call.delta("!") + call.finish(FinishReason.STOP, 5, 3)
    data = events(out)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello!"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)


def test_completion_json_encoding():
    call = OpenAICall("completions", "smollm2", stream=False, include_usage=False)
    assert call.delta("a") == "" and call.delta("b") == ""
    body = json.loads(call.finish(FinishReason.LENGTH, 2, 2))
    assert body["object"] == "text_completion" and body["choices"][0] == {"index": 0, "text": "ab", "logprobs": None, "finish_reason": "length"}
    assert body["usage"]["total_tokens"] == 4


def test_error_event_and_models():
    call = OpenAICall("chat", "smollm2", stream=True, include_usage=False)
    data = events(call.fail(ApiError(408, "timeout", "late")))
    assert json.loads(data[0])["error"]["code"] == "timeout" and data[-1] == "[DONE]"
    assert json.loads(models_list("smollm2", 1))["data"][0]["id"] == "smollm2"


def test_duplicate_keys_are_refused_as_on_the_native_route():
    with pytest.raises(ApiError) as err:
        parse_chat(b'{"model": "smollm2", "model": "other", "messages": [{"role": "user", "content": "x"}]}',
                   "smollm2", LIMITS)
    assert err.value.status == 400 and "duplicate" in err.value.message


def test_huge_integer_literal_is_a_400():
    body = b'{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "seed": ' + b"9" * 5000 + b"}"
    with pytest.raises(ApiError) as err:
        parse_chat(body, "smollm2", LIMITS)
    assert err.value.status == 400


def test_sampling_parameters_are_translated():
    req, call = parse("chat", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "n": 3,
                               "presence_penalty": 0.5, "frequency_penalty": -0.25, "logit_bias": {"11": -100, "0": 2},
                               "logprobs": True, "top_logprobs": 4, "seed": 9, "max_completion_tokens": 12})
    p = req.params
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.logprobs, p.seed, p.max_new_tokens) == (3, 0.5, -0.25, 4, 9, 12)
    assert p.logit_bias == ((11, -100.0), (0, 2.0)) and call.n == 3 and call.with_logprobs
    req, call = parse("chat", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "logprobs": False,
                               "top_logprobs": 0})
    assert req.params.logprobs is None and not call.with_logprobs
    req, call = parse("completions", {"model": "smollm2", "prompt": "x", "logprobs": 0})
    assert req.params.logprobs == 0 and call.with_logprobs
    with pytest.raises(ApiError) as err:
        parse("completions", {"model": "smollm2", "prompt": "x", "logprobs": 6})
    assert err.value.param == "logprobs"


def _item(token_id, text, logprob, top=()):
    from llm_api.text.logprobs import LogprobItem, TokenText

    def token(i, t):
        return TokenText(i, t, t.encode())

    return LogprobItem(token(token_id, text), logprob, tuple((token(i, t), v) for i, t, v in top))


def test_n_choices_and_logprobs_in_a_chat_stream():
    call = OpenAICall("chat", "smollm2", stream=True, include_usage=True, n=2, with_logprobs=True)
    out = (call.delta("Hi", 0, (_item(5, "Hi", -0.1, [(5, "Hi", -0.1), (6, "Ho", -2.5)]),))
           + call.delta("Yo", 1, (_item(7, "Yo", -0.7, [(8, "Ya", -0.6), (7, "Yo", -0.7)]),))
           + call.choice_finish(1, FinishReason.LENGTH)
           + call.delta("!", 0, (_item(9, "!", float("-inf")),))
           + call.finish(FinishReason.STOP, 4, 3))
    chunks = [json.loads(d) for d in events(out)[:-1]]
    by_index = {0: [], 1: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        by_index[choice["index"]].append(choice)
    assert [c["delta"].get("role") for c in by_index[0]][0] == "assistant" == by_index[1][0]["delta"]["role"]
    content = [e for c in by_index[0] if c["logprobs"] for e in c["logprobs"]["content"]]
    assert [e["token"] for e in content] == ["Hi", "!"] and content[0]["bytes"] == [72, 105]
    assert content[1]["logprob"] == -9999.0  # -inf is not JSON
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["Hi", "Ho"]
    assert [c["finish_reason"] for c in by_index[1] if c["finish_reason"]] == ["length"]
    assert [c["finish_reason"] for c in by_index[0] if c["finish_reason"]] == ["stop"]
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_n_choices_and_logprobs_in_a_completion_answer():
    call = OpenAICall("completions", "smollm2", stream=False, include_usage=False, n=2, with_logprobs=True)
    call.delta("ab", 0, (_item(1, "a", -0.5, [(1, "a", -0.5)]), _item(2, "b", -1.0, [(3, "c", -0.2)])))
    call.delta("c", 0, (_item(3, "c", -0.3),))
    call.delta("z", 1, (_item(4, "z", -0.1),))
    call.choice_finish(0, FinishReason.STOP)
    body = json.loads(call.finish(FinishReason.LENGTH, 2, 4))
    first, second = body["choices"]
    assert (first["index"], first["text"], first["finish_reason"]) == (0, "abc", "stop")
    assert (second["index"], second["text"], second["finish_reason"]) == (1, "z", "length")
    assert first["logprobs"] == {"tokens": ["a", "b", "c"], "token_logprobs": [-0.5, -1.0, -0.3],
                                 "top_logprobs": [{"a": -0.5}, {"c": -0.2, "b": -1.0}, {"c": -0.3}],
                                 "text_offset": [0, 1, 2]}


@pytest.mark.parametrize("kind, extra, names", [
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 20,
              "max_completion_tokens": 2048}, ("max_completion_tokens", "top_logprobs")),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 20, "max_tokens": 2048},
     ("max_tokens", "top_logprobs")),
    ("completions", {"prompt": "x", "logprobs": 5, "max_tokens": 2048}, ("max_tokens", "logprobs")),
])
def test_the_work_limit_names_this_formats_fields(kind, extra, names):
    """MAX_REQUEST_WORK (llm_api.service.admission.request_work) counts the same factors on every route; its
    refusal names them as this format spells them."""
    from llm_api.service.admission import request_work, work_refusal

    request, _ = parse(kind, {"model": "smollm2", "n": 64, **extra})
    entries = request.params.logprobs + 1
    assert request_work(10, request.params) == 10 + 64 * 2048 * (1 + entries)
    error = work_refusal(request, 10, 262_144)
    assert error.param == names[1] and error.code == "work_limit_exceeded"
    assert f"n=64 x {names[0]}=2048 x (1 + {entries} logprob entries per token: {names[1]}=" in error.message
    shape = error.openai_json()["error"]
    assert shape["type"] == "invalid_request_error" and shape["code"] == "work_limit_exceeded"
    single, _ = parse(kind, {"model": "smollm2", **extra})  # one choice of the same: an ordinary request
    assert work_refusal(single, 2048, 262_144) is None


def test_best_of_has_one_clear_answer():
    """best_of is not served: completions take only its neutral value (1, or null: the default), chat does not
    know it."""
    for neutral in (1, None):
        parse("completions", {"model": "smollm2", "prompt": "x", "best_of": neutral})
    with pytest.raises(ApiError) as err:
        parse("completions", {"model": "smollm2", "prompt": "x", "best_of": 4, "n": 2})
    assert (err.value.param, err.value.code) == ("best_of", "unsupported_parameter")
    assert "'best_of' is not supported by this server (only 1)" in err.value.message
    with pytest.raises(ApiError) as err:
        parse("chat", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "best_of": 1})
    assert (err.value.param, err.value.code) == ("best_of", "unknown_parameter")


CHAT_X = {"model": "smollm2", "messages": [{"role": "user", "content": "x"}]}


def test_the_chat_fields_clients_send_are_accepted_and_checked():
    """store, metadata, service_tier (echoed), modalities and prediction: accepted at their documented values;
    a bad value is a 400 naming the field, and any other unknown field stays a 400 naming it."""
    request, call = parse("chat", {**CHAT_X, "store": True, "metadata": {"run": "7"}, "service_tier": "auto",
                                   "modalities": ["text"], "prediction": {"type": "content", "content": "x y"}})
    assert request.messages and call.service_tier == "auto"
    assert call.delta("hi") == "" and json.loads(call.finish(FinishReason.STOP, 1, 1))["service_tier"] == "auto"
    streamed = parse("chat", {**CHAT_X, "service_tier": "default", "stream": True})[1]
    assert all(json.loads(e)["service_tier"] == "default" for e in events(streamed.delta("hi")))
    assert "service_tier" not in json.loads(parse("chat", CHAT_X)[1].finish(FinishReason.STOP, 1, 1))
    for extra, param in (({"modalities": ["audio"]}, "modalities[0]"), ({"store": "yes"}, "store"),
                         ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
                         ({"metadata": {"k": 1}}, "metadata"), ({"service_tier": "gold"}, "service_tier"),
                         ({"prediction": {"type": "image", "content": "x"}}, "prediction.type"),
                         ({"audio": {"voice": "x"}}, "audio")):
        with pytest.raises(ApiError) as err:
            parse("chat", {**CHAT_X, **extra})
        assert err.value.param == param and err.value.status == 400, (extra, err.value.param)


def test_completions_take_echo_token_ids_and_lists_of_prompts():
    requests, call = parse_completions(json.dumps({"model": "smollm2", "prompt": [[1, 2, 3], "abc"], "n": 2,
                                                            "echo": True, "logprobs": 1, "max_tokens": 0}).encode(),
                                 "smollm2", LIMITS)
    assert [r.token_ids for r in requests] == [[1, 2, 3], None] and requests[1].text == "abc"
    assert all(r.echo and r.echo_only and r.params.prompt_logprobs == 1 and r.params.max_new_tokens == 1
               for r in requests)
    assert call.n == 4
    request, _ = parse("completions", {"model": "smollm2", "prompt": [5, 6], "max_tokens": 3})
    assert request.token_ids == [5, 6] and not request.echo and request.params.prompt_logprobs is None
    with pytest.raises(ApiError) as err:
        parse("completions", {"model": "smollm2", "prompt": ["a", "b"]})
    assert err.value.param == "prompt"
