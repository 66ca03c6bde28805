"""Every limit a request must meet, in one place (llm_api.service.admission): each refusal in the order a request
meets it, the parameters admission hands the engine, and the one rule for a prompt of too many tokens. No model:
the limits are numbers (tests/test_admission.py runs admission in a service; the boundary with the engine is
checked there)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llm_api.errors import ApiError
from llm_api.service.request import GenerateRequest, Limits
from llm_api.engine.sampling_params import SamplingParams
from llm_api.service.admission import Admission

PACKAGE = Path(__file__).resolve().parent.parent / "llm_api"
LIMITS = Limits(max_input_tokens=100, max_new_tokens=50, max_request_work=10_000)


def _paged(kv_max_model_len: int = 120, **kw) -> Admission:
    return Admission(LIMITS, kv_max_model_len, "paged engine", True, kw.get("max_live", 4),
                     kw.get("max_tokens_in_flight", 1000))


def _refused(call, code: str) -> ApiError:
    with pytest.raises(ApiError) as refused:
        call()
    assert refused.value.code == code, refused.value
    return refused.value


def test_before_tokens_refuses_what_no_prompt_could_make_fit():
    admission = _paged()
    admission.before_tokens(GenerateRequest(text="x" * 400), max_chars_per_token=4)
    error = _refused(lambda: admission.before_tokens(GenerateRequest(text="x" * 401), 4), "prompt_too_long")
    assert "401 characters" in error.message and "MAX_INPUT_TOKENS=100" in error.message
    _refused(lambda: admission.before_tokens(GenerateRequest(token_ids=[1] * 101), 4), "prompt_too_long")
    # The work of the choices alone is over the limit, whatever the prompt: refused before tokenizing.
    error = _refused(lambda: admission.before_tokens(
        GenerateRequest(text="hi", params=SamplingParams(n=10, max_new_tokens=50, logprobs=20)), 4),
        "work_limit_exceeded")
    assert error.param == "logprobs" and "MAX_REQUEST_WORK=10,000" in error.message


def test_the_reference_path_refuses_what_only_the_paged_engine_does():
    reference = Admission(LIMITS, None, "generate() reference path", True, 4, 1000)
    echo = GenerateRequest(text="hi", params=SamplingParams(prompt_logprobs=1))
    assert _refused(lambda: reference.before_tokens(echo, 4), "unsupported_parameter").param == "echo"
    _paged().before_tokens(echo, 4)
    pooled = GenerateRequest(text="hi", params=SamplingParams(pooling="mean"))
    _refused(lambda: reference.before_tokens(pooled, 4), "unsupported_model")
    no_decoder = Admission(LIMITS, 120, "paged engine", False, 4, 1000)
    _refused(lambda: no_decoder.before_tokens(pooled, 4), "unsupported_model")


def test_after_tokens_checks_the_prompt_and_the_room_and_gives_the_engines_parameters():
    admission = _paged(kv_max_model_len=120)
    request = GenerateRequest(text="hi", params=SamplingParams(max_new_tokens=20))
    assert admission.after_tokens(request, 100) is request.params  # 100 + 20 = 120: fits exactly
    _refused(lambda: admission.after_tokens(request, 0), "empty_prompt")
    error = _refused(lambda: admission.after_tokens(request, 101), "prompt_too_long")
    assert "MAX_INPUT_TOKENS=100" in error.message
    roomy = GenerateRequest(text="hi", params=SamplingParams(max_new_tokens=30))
    error = _refused(lambda: admission.after_tokens(roomy, 100), "prompt_too_long")
    assert "exceed the 120 tokens the KV cache can hold" in error.message
    # A ceiling (Anthropic's max_tokens) is cut to the room instead, in the parameters the engine runs only.
    ceiling = GenerateRequest(text="hi", params=SamplingParams(max_new_tokens=30), max_tokens_fits=True)
    assert admission.after_tokens(ceiling, 100).max_new_tokens == 20 and ceiling.params.max_new_tokens == 30
    # The work counted with the prompt's tokens (echoed in every choice here).
    echoed = GenerateRequest(text="hi", params=SamplingParams(n=8, max_new_tokens=1, prompt_logprobs=20), echo=True)
    _paged(kv_max_model_len=1000).before_tokens(echoed, 4)
    _refused(lambda: _paged(kv_max_model_len=1000).after_tokens(echoed, 100), "work_limit_exceeded")


def test_a_calls_prompts_are_one_requests_work_and_capacity_is_a_503():
    admission = _paged(max_live=2, max_tokens_in_flight=100)
    admission.prompt_list([5_000, 5_000], 3)
    error = _refused(lambda: admission.prompt_list([5_000, 5_001], 3, "input"), "work_limit_exceeded")
    assert error.param == "input" and "first 2 of 3 prompts" in error.message
    admission.capacity(1, 60, 40)
    assert _refused(lambda: admission.capacity(2, 0, 1), "overloaded").status == 503
    assert "MAX_TOKENS_IN_FLIGHT=100" in _refused(lambda: admission.capacity(1, 60, 41), "overloaded").message


def test_too_long_is_decided_by_admission_alone():
    """'prompt_too_long' is raised in admission and, by its rule (``over_input_limit``), where a format learns a
    prompt's length while parsing; nowhere else (the Responses API's character bound on its items aside)."""
    raising = sorted(str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")
                     if re.search(r"""["']prompt_too_long["']""", path.read_text()))
    assert raising == ["llm_api/protocols/completions/translate.py", "llm_api/protocols/native/schema.py",
                       "llm_api/protocols/native/translate.py", "llm_api/protocols/responses/translate.py",
                       "llm_api/service/admission.py"], raising
    for path in ("protocols/completions/translate.py", "protocols/native/schema.py"):
        assert "over_input_limit(" in (PACKAGE / path).read_text(), path
