"""Input processing: a parsed request becomes what the engine takes, or its refusal (vLLM's input processor).

``InputProcessor`` renders and tokenizes prompts (``PromptBuilder``), converts embeddings and compiles a
request's grammar; every limit a request must meet is the ``Admission``'s (``llm_api.service.admission``), asked
here in the order a request meets them:

* ``check(request)``, before anything is tokenized: ``Admission.before_tokens``;
* ``prepare(request, owner, arrival)``: the token ids (or the embeddings tensor), then ``Admission.after_tokens``
  (which gives the sampling parameters the engine runs), the grammar (compiled on its own pool, by owner:
  ``llm_api.service.grammars``; 400 naming the field when the library rejects it), and the request's deadline
  (its ``timeout_s``, never beyond REQUEST_TIMEOUT_S) and cost in tokens for admission.

Prompts longer than ``OFF_LOOP_MIN_SIZE`` (characters, or embedding values) are prepared on a small thread
pool, off the event loop, which also serves ``offload`` (large bodies) and the tokenizer routes
(``tokenize``, ``detokenize``: vLLM's /tokenize and /detokenize, tokenizing exactly as ``prepare`` does).
A refusal raised on that pool leaves without its traceback (``_refusal_let_go``), so what the failed work
made is freed there, not on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch

from llm_api.engine.sampling_params import SamplingParams
from llm_api.errors import ApiError
from llm_api.model.loader import LoadedModel
from llm_api.model.settings import Settings
from llm_api.service.admission import Admission
from llm_api.service.grammars import GrammarCompilation
from llm_api.service.prompt import PromptBuilder
from llm_api.service.request import GenerateRequest, Limits, TokenizeRequest

# Prompts longer than this (characters, or embedding values) are prepared on the thread pool: below it
# the work (well under a millisecond) costs less than the hand-off.
OFF_LOOP_MIN_SIZE = 4096


@dataclass(frozen=True)
class Prepared:
    """A request ready for admission: its prompt as ids or embeddings, what it costs and when it expires."""

    prompt_ids: list[int] | None
    prompt_embeds: torch.Tensor | None
    num_prompt_tokens: int
    cost: int  # prompt + n x max_new_tokens: what it holds of MAX_TOKENS_IN_FLIGHT
    deadline: float  # monotonic
    # What the engine runs: the request's sampling parameters with its token limit cut to the KV room where it
    # is a ceiling, and its grammar compiled (the request itself is left as the route built it).
    params: SamplingParams


class InputProcessor:
    def __init__(self, settings: Settings, lm: LoadedModel, limits: Limits, admission: Admission):
        self.settings = settings
        self.lm = lm
        self.limits = limits
        self.admission = admission
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="llm-prepare")
        self.grammars = GrammarCompilation(lm.tokenizer, _logits_width(lm.model), lm.eos_token_ids)

    @functools.cached_property
    def prompts(self) -> PromptBuilder:
        return PromptBuilder(self.lm.tokenizer)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.grammars.shutdown()

    async def offload(self, fn, *args):
        """Run ``fn(*args)`` on the small worker pool (large prompts and bodies): the event loop keeps
        serving the other requests meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(_refusal_let_go, fn, *args))

    # ------------------------------------------------------------------------------------------
    # a generation request

    def check(self, request: GenerateRequest) -> None:
        """The refusals that need no tokens (``Admission.before_tokens``)."""
        self.admission.before_tokens(request, self.prompts.max_chars_per_token)

    async def prepare(self, request: GenerateRequest, owner: str, arrival: float) -> Prepared:
        """Tokenize, check and compile (module docstring): ``Prepared.params`` are what the engine runs; the
        request is not changed."""
        prompt_ids, prompt_embeds = await self._prompt(request)
        if prompt_ids is not None:
            num_prompt_tokens = len(prompt_ids)
        else:
            assert prompt_embeds is not None  # _prompt gives ids or embeddings
            num_prompt_tokens = int(prompt_embeds.shape[0])
        params = self.admission.after_tokens(request, num_prompt_tokens)
        deadline = arrival + min(request.timeout_s or self.settings.request_timeout_s, self.settings.request_timeout_s)
        if request.constraint is not None:
            params = dataclasses.replace(params, grammar=await self.grammars.compile(request.constraint, deadline, owner))
        return Prepared(prompt_ids, prompt_embeds, num_prompt_tokens, num_prompt_tokens + params.n * params.max_new_tokens,
                        deadline, params)

    async def _prompt(self, request: GenerateRequest) -> tuple[list[int] | None, torch.Tensor | None]:
        # (a tensor of embeddings, or token ids)
        work: Callable[[GenerateRequest], Any]
        result: Any
        if request.inputs_embeds is not None:
            work, size = self._embeds_tensor, len(request.inputs_embeds) * (self.limits.hidden_size or 1)
        else:
            work, size = self.prompts.token_ids, request.num_input_chars()
        if size < OFF_LOOP_MIN_SIZE:
            result = work(request)
        else:
            result = await asyncio.get_running_loop().run_in_executor(self._pool, work, request)
        return (None, result) if request.inputs_embeds is not None else (result, None)

    def _embeds_tensor(self, request: GenerateRequest) -> torch.Tensor:
        return torch.tensor(request.inputs_embeds, dtype=cast(torch.dtype, self.lm.model.dtype), device=self.lm.device)

    # ------------------------------------------------------------------------------------------
    # the tokenizer routes

    async def tokenize(self, request: TokenizeRequest) -> list[int]:
        """The ids a prompt or chat becomes, exactly as ``prepare`` would tokenize it (ApiError when it
        cannot be served: over MAX_INPUT_TOKENS, no chat template)."""
        as_generate = GenerateRequest(text=request.text, messages=request.messages)
        self._fits_before_tokens(as_generate)
        work = functools.partial(self.prompts.ids_of, request.text, request.messages, request.add_special_tokens)
        if as_generate.num_input_chars() < OFF_LOOP_MIN_SIZE:
            ids = work()
        else:
            ids = await asyncio.get_running_loop().run_in_executor(self._pool, work)
        return self._fits_in_tokens(ids)

    async def count_prompt_tokens(self, request: GenerateRequest) -> int:
        """How many tokens ``request``'s prompt is, exactly as ``prepare`` would tokenize it (Anthropic's
        count_tokens), with the same refusals (over MAX_INPUT_TOKENS, a template error)."""
        self._fits_before_tokens(request)
        if request.num_input_chars() < OFF_LOOP_MIN_SIZE:
            return len(self._fits_in_tokens(self.prompts.token_ids(request)))
        ids = await asyncio.get_running_loop().run_in_executor(self._pool, self.prompts.token_ids, request)
        return len(self._fits_in_tokens(ids))

    def _fits_before_tokens(self, request: GenerateRequest) -> None:
        refusal = self.admission.prompt_size(request, self.prompts.max_chars_per_token)
        if refusal is not None:
            raise refusal

    def _fits_in_tokens(self, ids: list[int]) -> list[int]:
        refusal = self.admission.prompt_tokens(len(ids))
        if refusal is not None:
            raise refusal
        return ids

    async def detokenize(self, token_ids: list[int]) -> str:
        work = functools.partial(self.lm.tokenizer.decode, token_ids)
        if len(token_ids) < OFF_LOOP_MIN_SIZE // 4:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)


def _logits_width(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.vocab_size)


def _refusal_let_go(fn, *args):
    """``fn(*args)``; an ``ApiError`` it raises leaves without its traceback and the exceptions it came from,
    whose frames hold what the parse made (a decoded 6 MB body: 66,000 objects), so they are freed here on
    the worker thread and not on the event loop that receives the error, where freeing them took 0.07-0.2 s
    with the GIL held (docs/reliability.md, "Hostile input, by class"). The edges render an error from its
    own fields, never from its traceback."""
    try:
        return fn(*args)
    except ApiError as error:
        error.__context__ = error.__cause__ = None
        raise error.with_traceback(None) from None
