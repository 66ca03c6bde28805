"""OpenAI's legacy completions: a body -> one ``GenerateRequest`` per prompt and the ``OpenAICall`` that
encodes the whole answer. The rules shared with chat (sampling parameters, ``n``, logprobs, streaming,
errors) are described in ``llm_api.protocols.chat.translate``; completions' own:

* Completions for evaluation harnesses (lm-eval's ``local-completions``): ``prompt`` is a string, a list
  of token ids, or a list of either (each prompt runs as its own request; prompt p's choice i is choice
  ``p * n + i``, as OpenAI numbers them; prompts x n at most MAX_NUM_SEQS). ``echo``: each choice's text
  begins with the prompt, and with ``logprobs`` its logprobs with the prompt tokens' (the first token's
  ``null``; computed by the engine over the whole prompt: ``SamplingParams.prompt_logprobs``); with echo,
  ``max_tokens`` may be 0 (the prompt alone, finish reason ``length``), and the token that ended the answer
  keeps its logprob entry (a harness counts prompt + sampled entries).
* Without ``max_tokens``: 16 tokens (OpenAI's default for this endpoint), at most MAX_NEW_TOKENS.
  ``best_of`` and ``suffix`` are taken only at their neutral values (null or 1, null or "").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Collection

from llm_api.errors import ApiError
from llm_api.protocols.common.checks import check_priority
from llm_api.protocols.common.openai import validate_call
from llm_api.protocols.common.openai_call import OpenAICall
from llm_api.protocols.common.sampling import check_token_range, to_sampling_params
from llm_api.protocols.completions.schema import NEUTRAL_VALUES, CompletionBody
from llm_api.service.admission import over_input_limit
from llm_api.service.request import GenerateRequest, Limits, ModelNames, WorkFields, adapter_of

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


def parse_completions(body: Any, model_name: ModelNames, limits: Limits, adapters: Collection[str] = (),
                      marker: str = "") -> tuple[list[GenerateRequest], OpenAICall]:
    """A completions body (bytes or an already decoded object) -> our requests (one per prompt of a list of
    prompts) and the encoder of the whole answer, whose choices are numbered prompt by prompt (prompt p's
    choice i is ``p * n + i``, as OpenAI numbers them). ``model`` is the base model's name or one of the LoRA
    ``adapters`` (the answer names the one asked); ``marker``: the native end-of-stream marker, which the
    encoder keeps out of its error texts."""
    call, _ = validate_call(CompletionBody, body, model_name, limits, adapters, neutral=NEUTRAL_VALUES)
    request = GenerateRequest(stream=True)  # the handler streams internally; the call encodes the answer
    logprobs = call.logprobs
    max_tokens = call.max_tokens
    request.echo = bool(call.echo)
    request.echo_only = request.echo and max_tokens == 0
    # (max_tokens 0 with echo: the prompt alone, as OpenAI serves it)
    check_token_range(max_tokens, "max_tokens", limits, lowest=0 if request.echo else 1,
                      note="" if request.echo else " (0 only with 'echo')")
    request.params = to_sampling_params(
        max_tokens=max_tokens, default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS, limits=limits,
        temperature=call.temperature, top_p=call.top_p, presence_penalty=call.presence_penalty,
        frequency_penalty=call.frequency_penalty, logit_bias=call.logit_bias, seed=call.seed, stop=call.stop,
        ignore_eos=call.ignore_eos, logprobs=logprobs, prompt_logprobs=logprobs if request.echo else None, n=call.n)
    request.work_fields = WorkFields("n", "max_tokens", "logprobs")
    request.adapter, request.adapter_param = adapter_of(call.model, model_name), "model"
    request.priority = check_priority(call.priority, limits)
    include_usage = call.stream_options is not None and call.stream_options.include_usage
    prompts = _prompts(call.prompt, limits)
    if len(prompts) * call.n > limits.max_n:
        raise ApiError(400, "invalid_value", f"{len(prompts)} prompts x n={call.n} choices exceed the "
                       f"{limits.max_n} sequences a request may run together (the server's MAX_NUM_SEQS)", "prompt")
    requests = [dataclasses.replace(request, text=p, params=request.params) if isinstance(p, str) else
                dataclasses.replace(request, token_ids=p) for p in prompts]
    return requests, OpenAICall(kind="completions", marker=marker, model=call.model, stream=call.stream,
                                include_usage=include_usage, n=call.n * len(requests),
                                with_logprobs=logprobs is not None)


def _prompts(value: Any, limits: Limits) -> list[str | list[int]]:
    """``prompt``: a string, a list of strings, a list of token ids or a list of such lists -> the prompts,
    each a non-empty string or a non-empty list of ids below the vocabulary size (a 400 names the item)."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_token_id(x) for x in value)):
        items, params = [value], ["prompt"]
    elif isinstance(value, list) and value:
        items, params = value, [f"prompt[{i}]" for i in range(len(value))]
    else:
        raise ApiError(400, "invalid_type" if not isinstance(value, list) else "missing_required_parameter",
                       "'prompt' must be a non-empty string, a list of strings, a list of token ids or a list of "
                       "lists of token ids", "prompt")
    prompts: list[str | list[int]] = []
    for item, param in zip(items, params):
        if isinstance(item, str):
            if not item:
                raise ApiError(400, "missing_required_parameter", f"'{param}' is empty", param)
            prompts.append(item)
            continue
        if not isinstance(item, list) or not item or not all(_is_token_id(x) for x in item):
            raise ApiError(400, "invalid_type", f"'{param}' must be a non-empty string or a non-empty list of "
                           "token ids (integers)", param)
        too_long = over_input_limit(len(item), limits.max_input_tokens)
        if too_long is not None:
            raise ApiError(400, "prompt_too_long", f"'{param}' {too_long}", param)
        vocab_size = limits.vocab_size
        bad = next((x for x in item if x < 0 or (vocab_size is not None and x >= vocab_size)), None)
        if bad is not None:
            raise ApiError(400, "invalid_value", f"'{param}' holds the token id {bad}, outside the vocabulary "
                           f"(0 to {(vocab_size or 0) - 1})", param)
        prompts.append(list(item))
    return prompts


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
