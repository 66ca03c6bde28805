"""Admission: every limit one request must meet, checked once, in one place, before the engine.

``Admission`` holds the bounds a parsed request is held to (MAX_REQUEST_WORK, MAX_INPUT_TOKENS, the tokens the
KV cache holds for one request, what the ``generate()`` reference path cannot do, and the server's in-flight
bounds) and is asked in the order a request meets them (``llm_api.service.input`` and ``.service`` ask):

* ``before_tokens(request, max_chars_per_token)``: before anything is tokenized, a request whose work is over
  MAX_REQUEST_WORK whatever its prompt, a prompt whose characters (or token ids) cannot fit MAX_INPUT_TOKENS, the
  prompt's logprobs or pooling on the reference path;
* ``after_tokens(request, num_prompt_tokens)``: a prompt of no tokens, or of more than MAX_INPUT_TOKENS; a token
  limit that is a ceiling (``GenerateRequest.max_tokens_fits``) cut to the KV cache's room after the prompt; the
  work with the prompt's tokens; prompt + max_new_tokens over the KV cache's room for one request. Returns the
  sampling parameters the engine runs;
* ``prompt_list(works, num_prompts, param)``: the prompts of one call (a completions prompt list, embeddings'
  inputs) are one request's work, summed against the same limit;
* ``capacity(num_live, tokens_in_flight, cost)``: 503 while the server holds MAX_NUM_SEQS + MAX_WAITING_REQUESTS
  requests or MAX_TOKENS_IN_FLIGHT tokens.

What a prompt of too many tokens is, is said here once (``over_input_limit``): the request formats that know a
prompt's length while parsing (token-id lists, embeddings' positions) refuse it by the same rule, naming their
field (the Responses API also bounds its input items' characters while it converts them, naming the item).
The engine and the scheduler check what they are handed for their direct callers (tests,
benchmarks: ids in the vocabulary, an empty prompt, a prompt at ``max_model_len``, n over ``max_num_seqs``);
behind the service those checks cannot fire, since the KV cache's room here is the engine's own
``max_model_len`` and every request reaches the engine through ``after_tokens``: a failure there is a bug, and
ends the stream with an internal error, not a 4xx.

``request_work`` is the one measure of what a request may cost (MAX_REQUEST_WORK bounds it; the service
refuses a request over it before anything runs, ``work_refusal``). In units of one generated token:

    work = prompt tokens x (1 + prompt logprob entries per token) x (n with echo, else 1)
           + n x max_new_tokens x (1 + logprob entries per token)

* the prompt is prefilled once, whatever ``n`` (the choices share its KV blocks): it adds, it does not
  multiply, unless the answer echoes it (``echo``: every choice renders the prompt and its logprobs);
* every choice may decode ``max_new_tokens`` tokens, each detokenized, encoded and sent: n x max_new_tokens;
* with logprobs k, each of those tokens also renders k + 1 entries (the token's own and k alternatives:
  text, bytes, a number) into the answer; an entry is counted as a whole token although it costs less
  (``bench/render_cost.py``: 8-20 us and 33-97 bytes per entry against 14-77 us per token without
  logprobs, on a 2-core EPYC), so the bound is conservative for rendering.

The other limits bound each factor alone (MAX_INPUT_TOKENS, MAX_NUM_SEQS, MAX_NEW_TOKENS, 20 logprobs);
only this bounds their product: 64 choices x 2,048 tokens x 21 entries (2.9 million units, an answer of
hundreds of MB rendered on the event loop) is refused, a chat of 2,048 tokens with top_logprobs 20 (47,104
units with a full prompt) is not. The measure uses what the request may ask for, not what it will use, so
it is known before anything runs.

A call with several prompts (``/v1/completions``' prompt list) is one request: the work of its prompts is
summed against the same limit (``Admission.prompt_list``, asked by ``llm_api.service.answer.admit``), so a list of 64
prompts each just under the limit is refused, naming the sum.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llm_api.errors import ApiError
from llm_api.service.request import GenerateRequest, Limits
from llm_api.engine.sampling_params import SamplingParams


def logprob_entries(logprobs: int | None) -> int:
    """Entries one generated token renders: none without logprobs, else its own and ``logprobs`` more."""
    return 0 if logprobs is None else logprobs + 1


def request_work(num_prompt_tokens: int, params: SamplingParams, echo: bool = False) -> int:
    """The module docstring's measure: prompt tokens x (1 + prompt logprob entries) x (n when echoed) + n x
    max_new_tokens x (1 + logprob entries)."""
    return (num_prompt_tokens * (1 + logprob_entries(params.prompt_logprobs)) * (params.n if echo else 1)
            + params.n * params.max_new_tokens * (1 + logprob_entries(params.logprobs)))


def work_refusal(request: GenerateRequest, num_prompt_tokens: int, limit: int | None,
                 params: SamplingParams | None = None) -> ApiError | None:
    """The 400 of a request whose work is over ``limit`` (MAX_REQUEST_WORK), else None. Before the prompt
    is tokenized, ``num_prompt_tokens`` = 0 refuses what is over the limit whatever the prompt. ``params``: the
    request's as they will run (a token limit cut to the KV room), else its own."""
    params, names = params or request.params, request.work_fields
    work = request_work(num_prompt_tokens, params, request.echo)
    if limit is None or work <= limit:
        return None
    entries = logprob_entries(params.logprobs)
    product = f"{names.n}={params.n} x {names.max_new_tokens}={params.max_new_tokens}"
    if entries:
        product += (f" x (1 + {entries} logprob entries per token: {names.logprobs}={params.logprobs} "
                    f"alternatives and the token's own)")
    prompt = f" + {num_prompt_tokens} prompt tokens" if num_prompt_tokens else ""
    if num_prompt_tokens and request.echo and params.n > 1:
        prompt += f" echoed in each of the {params.n} choices"
    # The field to change first: what multiplies the most.
    param = names.logprobs if entries else names.n if params.n > 1 else names.max_new_tokens
    return ApiError(400, "work_limit_exceeded", f"this request asks for {product}{prompt} = {work:,} units of work; "
                    f"the limit is MAX_REQUEST_WORK={limit:,} per request: ask for fewer choices, tokens or logprobs",
                    param)


def list_work_refusal(works: list[int], num_prompts: int, limit: int | None,
                      prompt_param: str = "prompt") -> ApiError | None:
    """The 400 of a call of ``num_prompts`` prompts whose first ones' work together (``works``: each prompt's
    ``request_work``, in order, as they are tokenized) is already over ``limit``, else None."""
    total = sum(works)
    if limit is None or total <= limit:
        return None
    which = f"{num_prompts} prompts" if len(works) == num_prompts else f"first {len(works)} of {num_prompts} prompts"
    return ApiError(400, "work_limit_exceeded", f"this request's {which} ask for {total:,} units of work "
                    f"together (each prompt's prompt tokens and choices counted as for one request); the limit is "
                    f"MAX_REQUEST_WORK={limit:,} per request: send fewer prompts, or fewer choices, tokens or "
                    f"logprobs", prompt_param)


def over_input_limit(num_tokens: int, limit: int, unit: str = "tokens") -> str | None:
    """What is wrong with a prompt of ``num_tokens`` tokens (``unit``: an embeddings prompt's positions) against
    ``limit`` (MAX_INPUT_TOKENS), else None: the one rule every place that learns a prompt's length applies, the
    formats that learn it while parsing (a completions token-id list, native ``inputs_embeds``) naming their field."""
    return f"has {num_tokens} {unit}; the limit is MAX_INPUT_TOKENS={limit}" if num_tokens > limit else None


def prompt_tokens_refusal(num_tokens: int, limit: int, param: str | None = None) -> ApiError | None:
    """The 400 of a prompt over MAX_INPUT_TOKENS (``over_input_limit``), else None."""
    wrong = over_input_limit(num_tokens, limit)
    return None if wrong is None else ApiError(400, "prompt_too_long", f"the prompt {wrong}", param)


@dataclass(frozen=True)
class Admission:
    """The limits (module docstring). ``kv_max_model_len``: the engine's ``max_model_len`` (None: the ``generate()``
    reference path, no KV cache); ``path_name``: how refusals name that path; ``can_pool``: the model gives its
    last hidden state (embeddings)."""

    limits: Limits
    kv_max_model_len: int | None
    path_name: str
    can_pool: bool
    max_live: int  # MAX_NUM_SEQS + MAX_WAITING_REQUESTS
    max_tokens_in_flight: int  # MAX_TOKENS_IN_FLIGHT

    def before_tokens(self, request: GenerateRequest, max_chars_per_token: int) -> None:
        """The refusals that need no tokens (module docstring); ``max_chars_per_token``: the most characters one
        token of the vocabulary covers, so a megabyte of text costs a length check, not a tokenizer run."""
        refusal = work_refusal(request, 0, self.limits.max_request_work) or self.prompt_size(request, max_chars_per_token)
        if refusal is not None:
            raise refusal
        if request.params.prompt_logprobs is not None and self.kv_max_model_len is None:
            raise ApiError(400, "unsupported_parameter", "'echo' with 'logprobs' (the prompt's logprobs) needs the "
                           f"paged engine; this model runs on the {self.path_name}", "echo")
        if request.params.pooling is not None and (self.kv_max_model_len is None or not self.can_pool):
            raise ApiError(400, "unsupported_model", "embeddings need the paged engine and a decoder model; this "
                           f"model runs on the {self.path_name}", "input")

    def after_tokens(self, request: GenerateRequest, num_prompt_tokens: int) -> SamplingParams:
        """The refusals of a tokenized prompt (module docstring); returns the sampling parameters the engine runs
        (the request's, with a ceiling token limit cut to the KV cache's room)."""
        if num_prompt_tokens == 0:  # (the engine has nothing to prefill: an answer needs one token to follow)
            raise ApiError(400, "empty_prompt", "the prompt becomes no tokens (it holds only characters the "
                           "tokenizer drops); send text the model can read")
        refusal = self.prompt_tokens(num_prompt_tokens)
        if refusal is not None:
            raise refusal
        params = request.params
        limit = self.kv_max_model_len
        room = None if limit is None else limit - num_prompt_tokens
        if request.max_tokens_fits and room is not None and 1 <= room < params.max_new_tokens:
            params = dataclasses.replace(params, max_new_tokens=room)
        refusal = work_refusal(request, num_prompt_tokens, self.limits.max_request_work, params)
        if refusal is not None:
            raise refusal
        if limit is not None and num_prompt_tokens + params.max_new_tokens > limit:
            raise ApiError(400, "prompt_too_long",
                           f"prompt ({num_prompt_tokens} tokens) + max_new_tokens ({params.max_new_tokens}) exceed the "
                           f"{limit} tokens the KV cache can hold for one request (KV_CACHE_MEMORY_MIB, "
                           f"MAX_INPUT_TOKENS, MAX_NEW_TOKENS)")
        return params

    def prompt_size(self, request: GenerateRequest, max_chars_per_token: int) -> ApiError | None:
        """A prompt over MAX_INPUT_TOKENS before it is tokenized: its token ids, or characters no tokenizing can
        fit (also what the tokenizer routes refuse)."""
        limit = self.limits.max_input_tokens
        if request.token_ids is not None:
            return prompt_tokens_refusal(len(request.token_ids), limit)
        chars = request.num_input_chars()
        if chars > limit * max_chars_per_token:
            return ApiError(400, "prompt_too_long", f"the prompt has {chars} characters, more than "
                            f"MAX_INPUT_TOKENS={limit} tokens can hold; shorten it")
        return None

    def prompt_tokens(self, num_prompt_tokens: int) -> ApiError | None:
        """A tokenized prompt over MAX_INPUT_TOKENS (also what the tokenizer routes refuse)."""
        return prompt_tokens_refusal(num_prompt_tokens, self.limits.max_input_tokens)

    def prompt_list(self, works: list[int], num_prompts: int, param: str = "prompt") -> None:
        """The prompts of one call admitted so far (``works``: each one's ``request_work``) together over
        MAX_REQUEST_WORK: refused, naming the sum."""
        refusal = list_work_refusal(works, num_prompts, self.limits.max_request_work, param)
        if refusal is not None:
            raise refusal

    def capacity(self, num_live: int, tokens_in_flight: int, cost: int) -> None:
        """503 while the server is full (``cost``: the request's prompt + n x max_new_tokens)."""
        if num_live >= self.max_live:
            raise ApiError(503, "overloaded", f"the server is busy: {num_live} requests in flight "
                           f"(MAX_NUM_SEQS + MAX_WAITING_REQUESTS = {self.max_live}); retry later")
        if tokens_in_flight + cost > self.max_tokens_in_flight:
            raise ApiError(503, "overloaded", f"the server is busy: {tokens_in_flight} tokens in flight, this "
                           f"request needs {cost} more (MAX_TOKENS_IN_FLIGHT={self.max_tokens_in_flight}); "
                           f"retry later")
