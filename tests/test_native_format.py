"""Request parsing: each malformed request is refused with its own type and a message naming it."""

import json

import pytest

from llm_api.errors import ApiError
from llm_api.protocols.native.translate import parse_request
from llm_api.service.request import Limits

LIMITS = Limits(max_input_tokens=8, max_new_tokens=100, hidden_size=4, vocab_size=1000, max_n=8)


def body(obj) -> dict:
    return {"body": json.dumps(obj).encode()}


def refused(row, type_=None, needle=None) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse_request(row, LIMITS)
    if type_:
        assert err.value.code == type_, err.value.message
    if needle:
        assert needle in err.value.message
    assert err.value.status == 400
    assert set(err.value.native_json()) == {"code", "type", "message"}
    return err.value


def test_json_text_with_params():
    req = parse_request(body({"text": "hi", "max_new_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 3,
                              "repetition_penalty": 1.2, "seed": 7, "stop": ["\n"]}), LIMITS)
    p = req.params
    assert req.text == "hi" and req.stream
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.seed, p.stop) == (5, 0.5, 0.9, 3, 1.2, 7, ("\n",))
    assert p.do_sample  # a sampling control implies sampling


def test_defaults_are_greedy():
    p = parse_request(body({"text": "hi"}), LIMITS).params
    assert p.greedy and p.max_new_tokens == 100  # default capped by MAX_NEW_TOKENS


def test_form_fields_are_coerced():
    req = parse_request({"text": b"hello", "max_new_tokens": b"3", "do_sample": b"false", "temperature": b"0.7",
                         "stop": b'["a", "b"]', "stream": b"false"}, LIMITS)
    assert req.params.max_new_tokens == 3 and not req.params.do_sample and req.params.temperature == 0.7
    assert req.params.stop == ("a", "b") and not req.stream


def test_messages_and_embeds():
    req = parse_request(body({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}), LIMITS)
    assert req.input_kind == "messages" and len(req.messages) == 2
    req = parse_request(body({"inputs_embeds": [[0.1, 0.2, 0.3, 0.4]] * 3}), LIMITS)
    assert req.input_kind == "inputs_embeds"
    req = parse_request({"messages": b'[{"role": "user", "content": "x"}]'}, LIMITS)
    assert req.messages[0]["content"] == "x"


@pytest.mark.parametrize(
    "row, type_, needle",
    [
        ({"body": b""}, "empty_body", "empty"),
        ({"body": b"   "}, "empty_body", "empty"),
        ({"body": b'{"text": "hi"'}, "invalid_json", "not valid JSON"),
        ({"body": b"[1, 2]"}, "invalid_json", "must be an object"),
        ({"body": b'"text"'}, "invalid_json", "must be an object"),
        ({"body": b'{"text": "\xff\xfe"}'}, "invalid_encoding", "UTF-8"),
        ({"body": b'{"text": "a", "text": "b"}'}, "invalid_json", "duplicate"),
        ({"body": b'{"text": "a", "temperature": NaN}'}, "invalid_json", "NaN"),
        ({"body": b'{"text": "a", "temperature": Infinity}'}, "invalid_json", "Infinity"),
        ({"body": b'{"text": "a", "x": ' + b"[" * 100 + b"]" * 100 + b"}"}, "invalid_json", "nested"),
        ({"body": b'{"text": "\\ud800"}'}, "invalid_input", "surrogate"),
        ({"body": b'{"text": "a\\u0000b"}'}, "invalid_input", "NUL"),
        ({}, "empty_body", None),
        ({"text": b"\xc3"}, "invalid_encoding", "UTF-8"),
    ],
)
def test_malformed_payloads(row, type_, needle):
    refused(row, type_, needle)


@pytest.mark.parametrize(
    "obj, type_, needle",
    [
        ({}, "missing_input", "one input"),
        ({"max_new_tokens": 3}, "missing_input", "one input"),
        ({"text": "a", "messages": [{"role": "user", "content": "b"}]}, "too_many_inputs", "text and messages"),
        ({"text": ""}, "invalid_input", "empty"),
        ({"text": 5}, "invalid_input", "string"),
        ({"text": "a", "bogus": 1}, "unknown_field", "'bogus'"),
        ({"messages": []}, "invalid_input", "non-empty"),
        ({"messages": "hello"}, "invalid_input", "non-empty array"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_input", "role"),
        ({"messages": [{"role": "user"}]}, "invalid_input", "content"),
        ({"messages": [["user", "x"]]}, "invalid_input", "object"),
        ({"inputs_embeds": [[0.1, 0.2]]}, "invalid_input", "hidden size is 4"),
        ({"inputs_embeds": [[0.1, 0.2, 0.3, "x"]]}, "invalid_input", "finite"),
        ({"inputs_embeds": [[0.1, 0.2, 0.3, True]]}, "invalid_input", "[0] holds a value that is not a finite number"),
        ({"inputs_embeds": [[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, "0.4"]]}, "invalid_input", "[1] holds a value"),
        ({"inputs_embeds": [[0.1, 0.2, 0.3, 10**400]]}, "invalid_input", "finite"),
        ({"inputs_embeds": [[1, 2, 3, 4]] * 9}, "prompt_too_long", "MAX_INPUT_TOKENS=8"),
        ({"inputs_embeds": []}, "invalid_input", "non-empty"),
        ({"inputs_embeds": [1, 2, 3, 4]}, "invalid_input", "array of numbers"),
        ({"text": "a", "temperature": -0.1}, "invalid_parameter", "'temperature'"),
        ({"text": "a", "temperature": "hot"}, "invalid_parameter", "'temperature' must be a number"),
        ({"text": "a", "temperature": True}, "invalid_parameter", "'temperature' must be a number"),
        ({"text": "a", "top_p": 0}, "invalid_parameter", "'top_p' must be in (0, 1]"),
        ({"text": "a", "top_p": 1.5}, "invalid_parameter", "'top_p'"),
        ({"text": "a", "top_k": -1}, "invalid_parameter", "'top_k'"),
        ({"text": "a", "top_k": 2.5}, "invalid_parameter", "'top_k' must be an integer"),
        ({"text": "a", "max_new_tokens": 0}, "invalid_parameter", "'max_new_tokens' must be between 1 and 100"),
        ({"text": "a", "max_new_tokens": 101}, "invalid_parameter", "'max_new_tokens'"),
        ({"text": "a", "max_new_tokens": 10**30}, "invalid_parameter", "'max_new_tokens'"),
        ({"text": "a", "max_new_tokens": "ten"}, "invalid_parameter", "'max_new_tokens' must be an integer"),
        ({"text": "a", "repetition_penalty": 0}, "invalid_parameter", "'repetition_penalty'"),
        ({"text": "a", "do_sample": "maybe"}, "invalid_parameter", "'do_sample'"),
        ({"text": "a", "seed": -1}, "invalid_parameter", "'seed'"),
        ({"text": "a", "stop": ["x"] * 17}, "invalid_parameter", "at most 16"),
        ({"text": "a", "stop": [1]}, "invalid_parameter", "'stop'"),
        ({"text": "a", "stop": [""]}, "invalid_parameter", "stop string"),
        ({"text": "a", "stream": "sometimes"}, "invalid_parameter", "'stream'"),
        ({"text": "a", "n": 2}, "invalid_parameter", "'n' needs \"output\": \"jsonl\""),
        ({"text": "a", "n": 9, "output": "jsonl"}, "invalid_parameter", "'n' must be between 1 and 8 (MAX_NUM_SEQS)"),
        ({"text": "a", "n": 0, "output": "jsonl"}, "invalid_parameter", "'n'"),
        ({"text": "a", "logprobs": 2}, "invalid_parameter", "'logprobs' needs"),
        ({"text": "a", "logprobs": 21, "output": "jsonl"}, "invalid_parameter", "'logprobs' must be between 0 and 20"),
        ({"text": "a", "output": "xml"}, "invalid_parameter", "'output'"),
        ({"text": "a", "presence_penalty": 2.5}, "invalid_parameter", "'presence_penalty' must be in [-2, 2]"),
        ({"text": "a", "frequency_penalty": "lots"}, "invalid_parameter", "'frequency_penalty'"),
        ({"text": "a", "logit_bias": {"1000": 5}}, "invalid_parameter", "token id 1000 is outside the vocabulary"),
        ({"text": "a", "logit_bias": {"-3": 5}}, "invalid_parameter", "'logit_bias' keys must be token ids"),
        ({"text": "a", "logit_bias": {"3": -101}}, "invalid_parameter", "the bias of token 3 must be in [-100, 100]"),
        ({"text": "a", "logit_bias": {"3": None}}, "invalid_parameter", "the bias of token 3 must be a number"),
        ({"text": "a", "logit_bias": {str(i): 1 for i in range(301)}}, "invalid_parameter", "at most 300"),
        ({"text": "a", "logit_bias": [[3, 1]]}, "invalid_parameter", "'logit_bias' must be an object"),
    ],
)
def test_invalid_requests(obj, type_, needle):
    refused(body(obj), type_, needle)


def test_cancel_request():
    from llm_api.service.request import CancelRequest

    assert parse_request(body({"cancel": "abc"}), LIMITS) == CancelRequest("abc")
    refused(body({"cancel": "abc", "text": "x"}), "invalid_request", "only the field")
    refused(body({"cancel": 5}), "invalid_input", "string")


def test_timeout_and_request_id():
    req = parse_request(body({"text": "x", "timeout": 2.5, "request_id": "mine"}), LIMITS)
    assert req.timeout_s == 2.5 and req.client_request_id == "mine"
    refused(body({"text": "x", "timeout": 0}), "invalid_parameter", "'timeout'")


def test_sampling_features_and_their_form_fields():
    req = parse_request(body({"text": "x", "n": 3, "logprobs": 5, "output": "jsonl", "presence_penalty": 0.5,
                              "frequency_penalty": -1, "logit_bias": {"7": -100, "12": 3.5}}), LIMITS)
    p = req.params
    assert (p.n, p.logprobs, p.presence_penalty, p.frequency_penalty) == (3, 5, 0.5, -1.0)
    assert p.logit_bias == ((7, -100.0), (12, 3.5)) and req.output == "jsonl"
    # gRPC's input map and HTTP forms carry text: the same values as strings and JSON text.
    form = parse_request({"text": b"x", "n": b"2", "logprobs": b"0", "output": b"jsonl", "presence_penalty": b"1",
                          "logit_bias": b'{"5": 2}'}, LIMITS)
    assert (form.params.n, form.params.logprobs, form.params.presence_penalty, form.params.logit_bias) == (2, 0, 1.0,
                                                                                                         ((5, 2.0),))
    plain = parse_request(body({"text": "x"}), LIMITS)
    assert plain.output == "text" and plain.params.n == 1 and plain.params.logprobs is None


def test_request_work_is_one_bound_on_the_product():
    """MAX_REQUEST_WORK's measure: prompt + n x max_new_tokens x (1 + logprob entries), the entries of a token
    being its own and its `logprobs` alternatives; the refusal names the product, the limit and the field
    that multiplies most."""
    from llm_api.service.admission import request_work, work_refusal

    limits = Limits(max_input_tokens=2048, max_new_tokens=2048, vocab_size=1000, max_n=64)
    extreme = parse_request(body({"text": "x", "n": 64, "max_new_tokens": 2048, "logprobs": 20, "output": "jsonl"}),
                            limits)
    assert request_work(0, extreme.params) == 64 * 2048 * 22 == 2_883_584
    error = work_refusal(extreme, 0, 262_144)
    assert error is not None and error.status == 400 and error.code == "work_limit_exceeded"
    assert "MAX_REQUEST_WORK=262,144" in error.message and "2,883,584" in error.message and error.param == "logprobs"
    assert "n=64 x max_new_tokens=2048 x (1 + 21 logprob entries per token: logprobs=20" in error.message
    # An ordinary long request passes: 2,048 tokens with 20 alternatives each and a full prompt.
    single = parse_request(body({"text": "x", "max_new_tokens": 2048, "logprobs": 20, "output": "jsonl"}), limits)
    assert request_work(2048, single.params) == 47_104 and work_refusal(single, 2048, 262_144) is None
    # So do all the choices MAX_NUM_SEQS allows, at full length, without logprobs.
    wide = parse_request(body({"text": "x", "n": 64, "max_new_tokens": 2048, "output": "jsonl"}), limits)
    assert request_work(2048, wide.params) == 133_120 and work_refusal(wide, 2048, 262_144) is None
    # The prompt counts: exactly at the limit passes, one token more is refused, and the message says so.
    at = parse_request(body({"text": "x", "n": 64, "max_new_tokens": 2047, "logprobs": 0, "output": "jsonl"}), limits)
    assert request_work(128, at.params) == 262_144 and work_refusal(at, 128, 262_144) is None
    error = work_refusal(at, 129, 262_144)
    assert error is not None and "+ 129 prompt tokens = 262,145 units" in error.message
    # Without logprobs the field named is n, or max_new_tokens for a single choice; no limit: no refusal.
    many = parse_request(body({"text": "x", "n": 2, "max_new_tokens": 100, "output": "jsonl"}), Limits(8, 100, max_n=8))
    assert work_refusal(many, 5, 150).param == "n" and work_refusal(many, 5, None) is None
    one = parse_request(body({"text": "x", "max_new_tokens": 100}), Limits(8, 100, max_n=8))
    assert work_refusal(one, 0, 99).param == "max_new_tokens"
