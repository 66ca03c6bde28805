"""Continuous-batching scheduler (pure Python, no torch), in the style of vLLM v1.

There are no prefill and decode phases: every request has ``num_computed_tokens`` that catches up with
its ``num_tokens`` (prompt + output). Each step ``schedule()`` first gives every running request its next
tokens (one for a decode, a chunk for an unfinished prefill), then admits waiting requests in arrival
order while the token budget (``max_num_batched_tokens``) and ``max_num_seqs`` allow; a long prompt is
prefilled in chunks over several steps. Full blocks whose tokens are already cached are reused instead
of recomputed (prefix caching). When a request needs a block and none is free, the NEWEST running
request is preempted: its blocks are freed, it goes back to the front of the waiting queue and its
prompt + output tokens are recomputed later, so its output is the same as without preemption.

``schedule()`` returns a ``SchedulerOutput``: per scheduled request, its new tokens, whether it samples,
and the block ids it got this step (``new_block_ids``; all of its blocks when ``is_new``, i.e. admitted or
resumed after preemption), plus the ids of requests that finished or were preempted since the last
output. The model runner keeps its own copy of each request's block table from these deltas (vLLM v1's
shape), so nothing below the scheduler depends on how the scheduler stores its lists.

``update()`` takes the token sampled for each request whose scheduled tokens reached its end, appends
it, finishes the request at EOS (unless ``ignore_eos``), at ``max_new_tokens`` or at ``max_model_len``,
and frees its blocks at once. ``abort()`` frees a request's blocks in any state.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from llm_api.engine.block_pool import BlockPool, hash_block
from llm_api.engine.request import FinishReason, Request, RequestOutput, RequestStatus


class PromptTooLongError(ValueError):
    """The prompt can never be served: it does not leave room for one token within the limit."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int  # most tokens (prompt + output) one request may reach; fits in the block pool


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    samples: bool  # this step reaches the request's last token, so a new token is sampled for it
    new_block_ids: list[int] = field(default_factory=list)  # blocks it got this step, in table order
    is_new: bool = False  # admitted or resumed this step: new_block_ids is its whole block table


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that left the running set since the previous output (finished, aborted, preempted): the
    # model runner drops its copy of their block tables.
    ended_request_ids: list[str] = field(default_factory=list)


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of those, tokens found cached (not recomputed)
    num_prefill_tokens_computed: int = 0  # prompt positions whose K/V were computed (recomputes count)
    num_decode_tokens_computed: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, eos_token_ids: set[int]):
        self.config = config
        self.block_pool = block_pool
        self.block_size = block_pool.block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.counters = SchedulerCounters()
        self._ended_request_ids: list[str] = []  # reported by the next schedule()

    # ----------------------------------------------------------------- requests in and out

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise PromptTooLongError(
                f"prompt has {request.num_prompt_tokens} tokens; the limit is "
                f"{self.config.max_model_len - 1} (max_model_len {self.config.max_model_len} "
                "including at least one generated token)"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request now and free its blocks; unknown or finished ids return None."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(ended_request_ids=self._ended_request_ids)
        self._ended_request_ids = []
        budget = self.config.max_num_batched_tokens

        # Running requests first: decodes and unfinished chunked prefills.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            num_blocks_before = len(request.block_ids)
            while not self._allocate_slots(request, num_new_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                output.preempted_request_ids.append(victim.request_id)
                output.ended_request_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                self._schedule(output, request, num_new_tokens, request.block_ids[num_blocks_before:], False)
                budget -= num_new_tokens
                index += 1
                continue
            break  # the request preempted itself: nothing behind it is left to schedule

        # Then admit waiting requests, unless memory was just short enough to preempt.
        while (
            self.waiting
            and budget > 0
            and not output.preempted_request_ids
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            hit_block_ids = self._find_cached_blocks(request)
            num_hit_tokens = len(hit_block_ids) * self.block_size
            num_new_tokens = min(request.num_tokens - num_hit_tokens, budget)
            if not self._allocate_slots(request, num_new_tokens, hit_block_ids):
                break
            self.waiting.popleft()
            if request.uses_prefix_cache:
                self.counters.prefix_cache_queries += request.num_tokens
                self.counters.prefix_cache_hits += num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.num_cached_blocks = len(hit_block_ids)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._schedule(output, request, num_new_tokens, list(request.block_ids), True)
            budget -= num_new_tokens
        return output

    def update(self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int]) -> list[RequestOutput]:
        """Advance every scheduled request; ``sampled_token_ids`` maps each sampling request to its token."""
        outputs = []
        for scheduled in output.scheduled:
            request = scheduled.request
            if request.is_finished:
                continue  # aborted after schedule(); its blocks are already free
            request.num_computed_tokens += scheduled.num_new_tokens
            self._cache_full_blocks(request)
            if not scheduled.samples:
                continue
            token_id = sampled_token_ids[request.request_id]
            request.output_token_ids.append(token_id)
            reason = self._stop_reason(request, token_id)
            if reason is not None:
                self._finish(request, reason)
            outputs.append(RequestOutput(request.request_id, [token_id], reason is not None, reason))
        if any(r.is_finished for r in self.running):
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    # ----------------------------------------------------------------- helpers

    def _schedule(self, output: SchedulerOutput, request: Request, num_new_tokens: int, new_block_ids: list[int],
                  is_new: bool) -> None:
        start = request.num_computed_tokens
        end = start + num_new_tokens
        samples = end == request.num_tokens
        output.scheduled.append(ScheduledRequest(request, num_new_tokens, samples, new_block_ids, is_new))
        output.num_batched_tokens += num_new_tokens
        num_prompt_positions = max(0, min(end, request.num_prompt_tokens) - start)
        self.counters.num_prefill_tokens_computed += num_prompt_positions
        self.counters.num_decode_tokens_computed += num_new_tokens - num_prompt_positions

    def _allocate_slots(self, request: Request, num_new_tokens: int, hit_block_ids: list[int] = ()) -> bool:
        """Give the request enough blocks for ``num_new_tokens`` more tokens; False if too few are free."""
        pool = self.block_pool
        num_computed = request.num_computed_tokens + len(hit_block_ids) * self.block_size
        num_needed = _cdiv(num_computed + num_new_tokens, self.block_size) - len(request.block_ids)
        num_needed -= len(hit_block_ids)
        # Hit blocks that nobody holds are in the free queue: taking them leaves fewer to allocate.
        num_hits_from_free = sum(1 for b in hit_block_ids if pool.ref_counts[b] == 0)
        if num_needed + num_hits_from_free > pool.num_free_blocks:
            return False
        pool.touch(hit_block_ids)
        request.block_ids.extend(hit_block_ids)
        if num_needed > 0:
            request.block_ids.extend(pool.allocate(num_needed))
        return True

    def _find_cached_blocks(self, request: Request) -> list[int]:
        if not (self.block_pool.enable_prefix_caching and request.uses_prefix_cache):
            return []
        self._extend_block_hashes(request)
        # Keep at least the last token to compute: its logits give the next token.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_block_ids = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block_id = self.block_pool.lookup(block_hash)
            if block_id is None:
                break
            hit_block_ids.append(block_id)
        return hit_block_ids

    def _extend_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < request.num_tokens // bs:
            start = len(hashes) * bs
            hashes.append(hash_block(hashes[-1] if hashes else None, request.token_ids(start, start + bs)))

    def _cache_full_blocks(self, request: Request) -> None:
        num_full_blocks = request.num_computed_tokens // self.block_size
        if not request.uses_prefix_cache or num_full_blocks <= request.num_cached_blocks:
            return
        self._extend_block_hashes(request)
        for i in range(request.num_cached_blocks, num_full_blocks):
            self.block_pool.cache_full_block(request.block_ids[i], request.block_hashes[i])
        request.num_cached_blocks = num_full_blocks

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        if token_id in self.eos_token_ids and not request.params.ignore_eos:
            return FinishReason.STOP
        if len(request.output_token_ids) >= request.params.max_new_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _preempt(self, request: Request) -> None:
        self._release_blocks(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self._ended_request_ids.append(request.request_id)
        self._release_blocks(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    def _release_blocks(self, request: Request) -> None:
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_cached_blocks = 0
