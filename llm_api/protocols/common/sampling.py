"""A request body's generation controls -> the engine's ``SamplingParams``: the one place they are built.

Every API (native, chat, completions, responses) passes the values its body gave (``None``: not given)
and its default token limit; the defaults of what was not given are decided here, once: temperature
1.0, top_p 1.0, top_k 0 (off), repetition penalty 1.0, penalties 0, no logit bias, no stop strings.
``do_sample`` not given means sampling when the temperature is above 0 (OpenAI's rule; the native API
passes its own, TGI's). ``check_token_range`` is the OpenAI-shaped APIs' check of the token limit a
body asks for (the native API checks its ``max_new_tokens`` in its schema).
"""

from __future__ import annotations

from llm_api.engine.sampling_params import SamplingParams
from llm_api.errors import ApiError
from llm_api.service.request import Limits


def check_token_range(value: int | None, param: str, limits: Limits, lowest: int = 1, note: str = "") -> None:
    """400 ``invalid_value`` naming ``param`` unless ``value`` (when given) is within ``lowest`` and
    MAX_NEW_TOKENS; ``note`` ends the message (completions: when 0 is allowed)."""
    if value is not None and not lowest <= value <= limits.max_new_tokens:
        raise ApiError(400, "invalid_value", f"'{param}' must be between {lowest} and {limits.max_new_tokens}" + note,
                       param)


def to_sampling_params(*, max_tokens: int | None, default_max_tokens: int, limits: Limits,
                       temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                       repetition_penalty: float | None = None, presence_penalty: float | None = None,
                       frequency_penalty: float | None = None, logit_bias: tuple[tuple[int, float], ...] | None = None,
                       do_sample: bool | None = None, seed: int | None = None, stop: tuple[str, ...] | None = None,
                       ignore_eos: bool = False, logprobs: int | None = None, prompt_logprobs: int | None = None,
                       n: int = 1, pooling: str | None = None) -> SamplingParams:
    """The engine's sampling parameters of one request (the module docstring has the defaults).

    ``max_tokens``: the body's token limit, already checked (0: an echo-only completion, for which the
    engine still samples one token that the answer drops); not given: ``default_max_tokens``, at most
    MAX_NEW_TOKENS (an API's "until the model stops" would ask the KV cache for MAX_NEW_TOKENS per
    request and refuse long prompts)."""
    temperature = 1.0 if temperature is None else temperature
    return SamplingParams(
        max_new_tokens=max(1, max_tokens) if max_tokens is not None else min(default_max_tokens,
                                                                            limits.max_new_tokens),
        temperature=temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=top_k or 0,
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
        presence_penalty=presence_penalty or 0.0,
        frequency_penalty=frequency_penalty or 0.0,
        logit_bias=logit_bias or (),
        do_sample=temperature > 0.0 if do_sample is None else do_sample,
        seed=seed,
        stop=stop or (),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        n=n,
        pooling=pooling,
    )
