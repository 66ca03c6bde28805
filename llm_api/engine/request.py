"""Per-request state shared by the scheduler, the model runner and the engine.

A ``Request`` is one sequence and holds token ids only (never text): the prompt, the tokens generated
so far, how many of them already have K/V in the paged cache (``num_computed_tokens``), the KV blocks it
holds, its status and, once finished, why, and the LoRA adapter it runs under (``lora_id``; the prefix
cache keys its blocks by it). A request built from ``prompt_embeds`` carries placeholder
prompt ids (its length is what counts) and never takes part in prefix caching.

A request asking for ``n`` > 1 answers is ``n`` sequences sharing one ``request_id``: choice ``index`` 0
is added first and prefills the prompt; the others (``UNFORKED`` until then) start from its KV blocks
when that prefill ends (see ``llm_api.engine.scheduler``). ``seq_id`` tells the sequences apart (the
request id itself for index 0), for whatever keeps per-sequence state (block tables).

``RequestOutput`` is what one engine step reports for one sequence: its new token ids, with their
``TokenLogprob`` when the request asked for logprobs. This module imports no torch, so the scheduler
stays torch-free.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from llm_api.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again; its blocks were freed and its tokens will be recomputed
    UNFORKED = "unforked"  # choice index > 0 waiting for index 0's prompt, whose blocks it will share
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request ended. The engine reports STOP (an EOS token), LENGTH, ABORT and NON_FINITE; the
    service adds STOP for a matched stop string (the same thing to a client)."""

    STOP = "stop"  # an EOS token, or a stop string
    LENGTH = "length"  # max_new_tokens or the model's length limit
    ABORT = "abort"
    NON_FINITE = "non_finite"  # its logits were NaN or infinite (a hostile LoRA adapter): ended alone


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of one sampled token and of the most likely alternatives at its position, in
    the distribution the token was drawn from (``llm_api.engine.sampler`` says which one)."""

    token_id: int
    logprob: float  # may be -inf for an alternative that top-k / top-p removed
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one sequence: the new token ids and whether the sequence ended."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None  # set once finished
    index: int = 0  # which of the request's n sequences (choices)
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per new token, when the request asked for them
    # On a sequence's first output, when the request asked for prompt logprobs: one per prompt token after
    # the first (entry i scores prompt token i + 1).
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    # Prompt tokens whose K/V came from the prefix cache when the sequence was first admitted (usage's
    # cached tokens); 0 from an engine without a prefix cache.
    num_cached_tokens: int = 0
    # On the first output of a request with params.pooling: the pooled prompt hidden state (float32 [H], on
    # the CPU; not normalized).
    embedding: Any = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling_state: Any = None  # llm_api.engine.sampler.SamplingState, built by the engine
    # llm_api.structured.matcher.GrammarMatcher of a structured-output request (params.grammar), built by
    # the engine, which also advances it with each token it keeps. It has accepted every token of
    # output_token_ids, so it stays valid across preemption: a preempted request keeps its output tokens,
    # and its recompute samples only after the last of them.
    grammar_matcher: Any = None
    prompt_embeds: Any = None  # torch.Tensor [num_prompt_tokens, hidden_size] or None
    draft_state: Any = None  # llm_api.engine.speculative.drafter.DraftState, made by the drafter on first use
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # leading tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)  # the scheduler's; the runner keeps its own copy
    # Chained content hash of each full block of (prompt + output) tokens, filled as blocks fill up.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading block_ids already registered in the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    index: int = 0  # choice index among the request's n sequences
    seq_id: str = ""  # unique among live sequences: request_id for index 0, set in __post_init__
    lora_id: int = 0  # the LoRA adapter's load id (llm_api.lora.registry); 0: the base model
    priority: int = 0  # vLLM's: a lower value is served first; equal values in arrival order (the scheduler)
    # Whose share of the engine it runs in (llm_api.engine.fair_share; "" where no key is checked): priorities
    # compare only between one owner's requests.
    owner: str = ""
    # How this sequence ranks against other owners' (a lower rank first; set by Scheduler.add from its priority
    # and its owner's grant: SchedulerConfig.priority_grants). 0 for every owner without a grant.
    rank: int = 0
    # params.prompt_logprobs: the prompt's logprobs computed so far (entry i scores prompt token i + 1); a
    # recompute after preemption does not compute them twice.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # params.pooling: the prompt's final hidden states pooled so far (float32 [H]: their sum for "mean", the
    # latest row for "last") over its first num_pooled positions; a recompute after preemption goes on from there.
    pooled: Any = None
    num_pooled: int = 0
    # Prompt tokens found in the prefix cache at the first admission (-1 until then): what usage reports
    # as cached. A readmission after preemption does not change it (the client's prompt was served once).
    num_cached_tokens: int = -1

    def __post_init__(self):
        if not self.seq_id:
            self.seq_id = self.request_id if self.index == 0 else f"{self.request_id}/{self.index}"

    @property
    def prefix_salt(self) -> bytes | None:
        """What the first block's hash chains from: K/V computed under one adapter are never another's."""
        return f"lora:{self.lora_id}".encode() if self.lora_id else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def uses_prefix_cache(self) -> bool:
        # Placeholder prompt ids of an embeddings request say nothing about its content.
        return self.prompt_embeds is None

    @property
    def needs_prompt_logits(self) -> bool:
        """Asked for prompt logprobs and has not got them all: every prompt position is computed (no
        prefix-cache hits) and the runner keeps the logits of those still missing."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def needs_prompt_hidden(self) -> bool:
        """Pools the prompt's hidden states (embeddings) and has not pooled them all: every prompt position is
        computed (no prefix-cache hits) and the runner keeps the rows of those still missing."""
        return self.params.pooling is not None and self.num_pooled < self.num_prompt_tokens

    def pooled_embedding(self) -> Any:
        """The prompt's pooled hidden state once every position was pooled (module docstring of the runner)."""
        if self.pooled is None or self.num_pooled < self.num_prompt_tokens:
            return None
        return self.pooled / self.num_prompt_tokens if self.params.pooling == "mean" else self.pooled

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output, without copying both lists."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
