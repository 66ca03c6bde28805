"""Continuous-batching scheduler (pure Python, no torch), in the style of vLLM v1.

There are no prefill and decode phases: every request has ``num_computed_tokens`` that catches up with
its ``num_tokens`` (prompt + output). Each step ``schedule()`` first gives every running request its next
tokens (one for a decode, a chunk for an unfinished prefill), then admits waiting requests in arrival
order while the token budget (``max_num_batched_tokens``) and ``max_num_seqs`` allow; a long prompt is
prefilled in chunks over several steps. Full blocks whose tokens are already cached are reused instead
of recomputed (prefix caching; a request under a LoRA adapter only reuses blocks of that adapter, the
hash chain starting from its ``prefix_salt``). At most ``max_loras`` adapters run at once: a waiting
request of another adapter lets the requests behind it go first. When a request needs a block and none is free, the NEWEST running
request is preempted: its blocks are freed, it goes back to the front of the waiting queue and its
prompt + output tokens are recomputed later, so its output is the same as without preemption.

Priorities (``Request.priority``, vLLM's ``priority`` field: a lower value first, arrival order within a
value): the waiting queue is kept in priority order (a new request goes behind every waiting one of its
own or a better priority, a preempted one in front of those of its own), the running set is scheduled in
priority order, so memory short preempts the newest sequence of the worst priority running, and a waiting
request that cannot be admitted for want of blocks or sequence slots preempts running sequences of a
worse priority (worst and newest first) until it can. With every priority equal (the default, 0) all of
this is exactly the plain first-come order above.

Owners (``Request.owner``: the key that sent it; llm_api.engine.fair_share says how service is counted and
what a share is): with several owners active, the running set is ordered least-served owner first (each
owner's in the priority order above), waiting requests are admitted least-served owner first (each owner's
queue in its own order), an owner is capped at its share of the sequences and blocks while another owner
waits, a waiting owner within its share that lacks room preempts the owner furthest over its share (its
newest sequences), memory short preempts from the owner furthest over its share, and a running prefill
chunk leaves up to half the budget to the first chunks of less-served owners waiting. Priorities compare
only within an owner, unless the operator grants an owner more: ``SchedulerConfig.priority_grants`` gives a
sequence its ``rank`` against other owners' (``max(grant, min(priority, 0))``: 0 for every owner without a
grant), and ranks come before everything above: the running set is ordered by rank first, a waiting owner's
head of a better rank is admitted before the others' (and is not capped at its share by owners waiting at a
worse rank), preempts running sequences of a worse rank for room like a better priority within an owner,
and is never a victim of the shares of owners at a worse rank. With one owner (every request's owner "", the
default) none of this changes anything.

The rules that take room from running sequences for others (for a better rank or priority, for a share,
the victim when memory is short, a prefill chunk's reservation) are ``llm_api.engine.precedence``'s, which
``Scheduler`` derives from; its limits are ``SchedulerConfig`` (``llm_api.engine.scheduler_config``); each
sequence's blocks (prefix hits, allocation, copy on write, release) are ``llm_api.engine.sequence_blocks``'.

``schedule()`` returns a ``SchedulerOutput`` (``llm_api.engine.scheduler_output``): per scheduled request,
its new tokens, whether it samples and the block ids it got this step, plus the ids of requests that left
the running set since the last output: deltas the model runner keeps its own block tables from.

``update()`` takes the token sampled for each sequence whose scheduled tokens reached its end, appends
it, finishes the sequence at EOS (unless ``ignore_eos``), at ``max_new_tokens`` or at ``max_model_len``,
and frees its blocks at once. ``abort()`` frees a request's blocks in any state.

n > 1 (parallel sampling): ``add(request, siblings)`` takes choice 0 and the other n - 1 sequences
(``UNFORKED``). Only choice 0 is admitted and prefills the prompt; admission counts all n against
``max_num_seqs``. The step that completes its prompt lists the siblings in ``ScheduledRequest.forks``:
the engine samples each sibling's first token from the same logits row, and ``update()`` forks them:
each takes a reference on every block of choice 0 (the prompt's K/V are held once) and starts running.
A block written by a sequence is never shared, so the one partial block at the end of the prompt is
copied on write: the first sharer that is about to write into a block with other holders gets a fresh
block, and ``SchedulerOutput.block_copies`` tells the model runner to copy the K/V before the forward
(its table is then reported whole again, ``is_new``). The last holder writes in place, so n sequences
cost the prompt's full blocks once plus at most n - 1 copied partial blocks. A forked sequence is an
ordinary one afterwards: preempted, it recomputes (re-using the prompt's cached blocks when it can).

Speculative decoding (``drafter``, ``llm_api.engine.speculative``): on a step with at most
``max_batch`` decoding sequences, a decoding sequence may get a draft of k tokens
(``ScheduledRequest.draft_token_ids``): it is scheduled 1 + k tokens (its last token and the draft,
counted against the token budget; blocks for all of them, or no draft when they are not free). ``update()``
then takes the list of tokens the verification produced for it (accepted draft tokens + one) and
advances ``num_computed_tokens`` over the last token and the accepted drafts only: the rejected
positions' K/V slots are overwritten later, the blocks stay with the sequence (freed with it), and the
prefix cache registers only blocks that are full of accepted tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from llm_api.engine.block_pool import BlockPool
from llm_api.engine.fair_share import FairShare
from llm_api.engine.precedence import Precedence
from llm_api.engine.request import FinishReason, Request, RequestOutput, RequestStatus, TokenLogprob
from llm_api.engine.scheduler_config import SchedulerConfig
from llm_api.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from llm_api.engine.sequence_blocks import SequenceBlocks
from llm_api.engine.speculative.drafter import Drafter


class PromptTooLongError(ValueError):
    """The prompt can never be served: it does not leave room for one token within the limit."""


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of those, tokens found cached (not recomputed)
    num_prefill_tokens_computed: int = 0  # prompt positions whose K/V were computed (recomputes count)
    num_decode_tokens_computed: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler(Precedence):
    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, eos_token_ids: set[int],
                 drafter: Drafter | None = None):
        self.config = config
        self.drafter = drafter
        self.block_pool = block_pool
        self.block_size = block_pool.block_size
        self.blocks = SequenceBlocks(block_pool)  # each sequence's blocks: taken, cached, released
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}  # every unfinished sequence, by seq_id
        self.groups: dict[str, list[Request]] = {}  # request id -> its unfinished sequences
        self.counters = SchedulerCounters()
        self._ended_request_ids: list[str] = []  # reported by the next schedule()
        self._unforked: dict[str, list[Request]] = {}  # seq id of a choice 0 -> siblings waiting for its prompt
        self._untold: set[str] = set()  # forked sequences whose block table the runner has not seen yet
        self.fair = FairShare(config.max_num_seqs, block_pool.num_blocks)

    # ----------------------------------------------------------------- requests in and out

    def add(self, request: Request, siblings: Sequence[Request] = ()) -> None:
        """Queue a request (choice 0) and, for n > 1, its other sequences (same request id, index 1..n-1)."""
        sequences = [request, *siblings]
        if request.request_id in self.groups or any(s.seq_id in self.requests for s in sequences):
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if len(sequences) > self.config.max_num_seqs:
            raise ValueError(f"n={len(sequences)} exceeds max_num_seqs={self.config.max_num_seqs}")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise PromptTooLongError(
                f"prompt has {request.num_prompt_tokens} tokens; the limit is "
                f"{self.config.max_model_len - 1} (max_model_len {self.config.max_model_len} "
                "including at least one generated token)"
            )
        request.status = RequestStatus.WAITING
        for sibling in siblings:
            sibling.status = RequestStatus.UNFORKED
        for sequence in sequences:
            self.requests[sequence.seq_id] = sequence
        self.groups[request.request_id] = sequences
        if siblings:
            self._unforked[request.seq_id] = list(siblings)
        self.fair.join(request.owner, len(sequences))
        rank = max(self.config.priority_grants.get(request.owner, 0), min(request.priority, 0))
        for sequence in sequences:
            sequence.rank = rank
        # Behind every waiting request of its own or a better priority (equal priorities: appended).
        position = len(self.waiting)
        while position > 0 and self.waiting[position - 1].priority > request.priority:
            position -= 1
        self.waiting.insert(position, request)

    def end_non_finite(self, request: Request) -> list[Request]:
        """End a running sequence whose logits were not finite, with the siblings waiting to fork from it
        (their prompt blocks are its blocks): its blocks leave the prefix cache and are zeroed once freed
        (``BlockPool.taint``). Returns the sequences ended."""
        sequences = [request, *self._unforked.get(request.seq_id, ())]
        self.block_pool.taint(request.block_ids)
        for sequence in sequences:
            if sequence.status is RequestStatus.RUNNING:
                self.running.remove(sequence)
            self._finish(sequence, FinishReason.NON_FINITE)
        return sequences

    def abort(self, request_id: str, index: int | None = None) -> list[Request]:
        """Finish the request's unfinished sequences now (only choice ``index`` when given) and free their
        blocks; returns them (none for unknown ids). Choice 0 aborted before its prompt is done takes
        the siblings waiting for it along."""
        sequences = list(self.groups.get(request_id, ()))
        if index is not None:
            chosen = [s for s in sequences if s.index == index]
            sequences = chosen + [sibling for c in chosen for sibling in self._unforked.get(c.seq_id, ())]
        for request in sequences:
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status is not RequestStatus.UNFORKED:
                self.waiting.remove(request)
            self._finish(request, FinishReason.ABORT)
        return sequences

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(ended_request_ids=self._ended_request_ids)
        self._ended_request_ids = []
        budget = self.config.max_num_batched_tokens
        fair = self.fair
        # The best rank first, then the least-served owner's sequences, each owner's in priority order (stable:
        # admission order within a priority), so the last one belongs to the most-served owner of the worst rank
        # and is preempted first. (One owner: its counter orders nothing, and is neither read nor kept:
        # fair_share.FairShare.charge; its ranks follow its priorities.)
        if fair.num_active > 1:
            self.running.sort(key=lambda r: (r.rank, fair.served_of(r.owner), r.priority))
        else:
            self.running.sort(key=lambda r: r.priority)
        self._preempt_for_priority(output)
        self._preempt_for_share(output)

        # Running requests first: decodes and unfinished chunked prefills. A prefill chunk leaves room for the
        # first chunks of the owners served less that wait (reserved_for: a step's admission of another owner
        # is never crowded out by an owner's long prompts).
        reserved_for = self._reservations()
        memory_short = False
        speculate = self._speculates()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new_tokens > 1 and reserved_for:
                num_new_tokens = min(num_new_tokens, budget - reserved_for.get(request.owner, 0))
                if num_new_tokens <= 0:
                    index += 1
                    continue
            num_blocks_before = len(request.block_ids)
            num_copies_before = len(output.block_copies)
            draft = (self._draft(request, budget, len(self.running) - 1 - index, output.block_copies)
                     if speculate else [])
            num_new_tokens += len(draft)
            while not self.blocks.allocate_slots(request, num_new_tokens, copies=output.block_copies):
                victim = self._victim(index)
                self.running.remove(victim)
                self._preempt(victim, output)
                memory_short = True
                if victim is request:
                    break
            else:
                if request.seq_id in self._untold or len(output.block_copies) > num_copies_before:
                    # Forked, or its last block was copied on write: the runner rebuilds its table.
                    self._untold.discard(request.seq_id)
                    self._schedule(output, request, num_new_tokens, list(request.block_ids), True, draft)
                else:
                    self._schedule(output, request, num_new_tokens, request.block_ids[num_blocks_before:], False,
                                   draft)
                budget -= num_new_tokens
                index += 1
                continue
            # The request preempted itself: the one at ``index`` is now the next (none: the loop ends).

        # Then admit waiting requests, unless memory was just short enough to preempt: the least-served
        # owner's next request first. A running choice 0 still prefilling keeps room for the siblings it will
        # fork. Requests of an adapter that cannot join (MAX_LORAS others run) wait; the owner's next may go.
        num_seqs = self._num_running_seqs()
        running_loras = {r.lora_id for r in self.running if r.lora_id}
        queues: dict[str, list[Request]] = {}
        for waiting in self.waiting:
            queues.setdefault(waiting.owner, []).append(waiting)
        # (an owner capped below still waits: the others stay capped too)
        head_ranks = {owner: queue[0].rank for owner, queue in queues.items()}
        usage = self._usage() if len(head_ranks) > 1 else None
        while queues and budget > 0 and not memory_short:
            # (charged as it is admitted: owners of one rank alternate)
            owner = min(queues, key=lambda o: (queues[o][0].rank, fair.served_of(o)))
            queue = queues[owner]
            request = queue[0]
            if self._lora_blocked(request, running_loras):
                self._drop_head(queues, owner)
                continue
            num_siblings = len(self._unforked.get(request.seq_id, ()))
            hit_block_ids = self.blocks.find_cached_blocks(request)
            num_hit_tokens = len(hit_block_ids) * self.block_size
            num_new_tokens = min(request.num_tokens - num_hit_tokens, budget)
            # Another owner of its rank or a better one waits: this one stays within its share.
            if usage is not None and any(rank <= request.rank for o, rank in head_ranks.items() if o != owner):
                held_seqs, held_blocks = usage.get(owner, (0, 0))
                if not fair.within_share(held_seqs + 1 + num_siblings,
                                         held_blocks + sum(self.blocks.blocks_to_take(request, num_new_tokens, hit_block_ids))):
                    del queues[owner]
                    continue
            if num_seqs + 1 + num_siblings > self.config.max_num_seqs:
                break  # its n sequences will run together: wait until they fit
            num_blocks_before = len(request.block_ids)
            if not self.blocks.allocate_slots(request, num_new_tokens, hit_block_ids):
                break
            self._drop_head(queues, owner)
            self.waiting.remove(request)
            if usage is not None:
                held_seqs, held_blocks = usage.get(owner, (0, 0))
                usage[owner] = (held_seqs + 1 + num_siblings, held_blocks + len(request.block_ids) - num_blocks_before)
            if request.lora_id:
                running_loras.add(request.lora_id)
            if request.uses_prefix_cache:
                self.counters.prefix_cache_queries += request.num_tokens
                self.counters.prefix_cache_hits += num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = min(num_hit_tokens, request.num_prompt_tokens)
            request.num_computed_tokens = num_hit_tokens
            request.num_cached_blocks = len(hit_block_ids)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._schedule(output, request, num_new_tokens, list(request.block_ids), True)
            budget -= num_new_tokens
            num_seqs += 1 + num_siblings
        return output

    @staticmethod
    def _drop_head(queues: dict[str, list[Request]], owner: str) -> None:
        queue = queues[owner]
        del queue[0]
        if not queue:
            del queues[owner]

    def update(self, output: SchedulerOutput, sampled_token_ids: Mapping[str, Any],
               sampled_logprobs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Advance every scheduled sequence; ``sampled_token_ids`` maps each sampling sequence (and each
        sibling it forks) by seq id to its token, ``sampled_logprobs`` to its ``TokenLogprob`` when asked
        for. A sequence scheduled with a draft maps to the list of tokens its verification produced (and
        a tuple of their logprobs)."""
        outputs = []
        for scheduled in output.scheduled:
            request = scheduled.request
            if request.is_finished:
                continue  # aborted after schedule(); its blocks are already free
            if scheduled.draft_token_ids:
                outputs.append(self._append_verified(scheduled, sampled_token_ids, sampled_logprobs))
                continue
            request.num_computed_tokens += scheduled.num_new_tokens
            self.blocks.cache_full_blocks(request)
            if not scheduled.samples:
                continue
            siblings = scheduled.forks
            if siblings or request.seq_id in self._unforked:
                del self._unforked[request.seq_id]
                for sibling in siblings:  # before choice 0 may finish and free the shared blocks
                    self._fork(request, sibling)
            for sequence in (request, *siblings):
                outputs.append(self._append_token(sequence, sampled_token_ids, sampled_logprobs))
        if any(r.is_finished for r in self.running):
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _append_token(self, request: Request, sampled_token_ids: Mapping[str, int],
                      sampled_logprobs: Mapping[str, TokenLogprob] | None) -> RequestOutput:
        token_id = sampled_token_ids[request.seq_id]
        request.output_token_ids.append(token_id)
        reason = self._stop_reason(request, token_id)
        if reason is not None:
            self._finish(request, reason)
        logprob = sampled_logprobs.get(request.seq_id) if sampled_logprobs else None
        first = len(request.output_token_ids) == 1
        prompt_logprobs = (tuple(request.prompt_logprobs) if request.params.prompt_logprobs is not None
                           and first else None)
        return RequestOutput(request.request_id, [token_id], reason is not None, reason, request.index,
                             (logprob,) if logprob is not None else None, prompt_logprobs,
                             max(request.num_cached_tokens, 0),
                             request.pooled_embedding() if first and request.params.pooling is not None else None)

    def _append_verified(self, scheduled: ScheduledRequest, sampled_token_ids: Mapping[str, Any],
                         sampled_logprobs: Mapping[str, Any] | None) -> RequestOutput:
        """A drafted sequence: K/V are kept for its last token and the accepted drafts (every verified token
        but the last, which is new), then its tokens are appended up to the first stop."""
        request = scheduled.request
        token_ids: list[int] = sampled_token_ids[request.seq_id]
        num_accepted = len(token_ids) - 1
        if self.drafter is not None:
            self.drafter.record(request, len(scheduled.draft_token_ids), num_accepted)
        request.num_computed_tokens += 1 + num_accepted
        logprobs = sampled_logprobs.get(request.seq_id) if sampled_logprobs else None
        reason = None
        appended = []
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            appended.append(token_id)
            reason = self._stop_reason(request, token_id)
            if reason is not None:
                break
        if reason is not None:
            self._finish(request, reason)  # (frees the blocks: nothing to register)
        else:
            self.blocks.cache_full_blocks(request)  # (after the append: the hashes need the accepted tokens)
        return RequestOutput(request.request_id, appended, reason is not None, reason, request.index,
                             tuple(logprobs[: len(appended)]) if logprobs else None,
                             num_cached_tokens=max(request.num_cached_tokens, 0))

    def _fork(self, parent: Request, sibling: Request) -> None:
        """Start ``sibling`` from ``parent``'s computed prompt: it shares every block (one reference more)."""
        self.block_pool.touch(parent.block_ids)
        sibling.block_ids = list(parent.block_ids)
        sibling.num_computed_tokens = parent.num_computed_tokens
        sibling.block_hashes = list(parent.block_hashes)
        sibling.num_cached_blocks = parent.num_cached_blocks
        sibling.num_cached_tokens = parent.num_cached_tokens
        sibling.prompt_logprobs = parent.prompt_logprobs  # (the same prompt; never changed once complete)
        sibling.status = RequestStatus.RUNNING
        self.running.append(sibling)
        self._untold.add(sibling.seq_id)

    # ----------------------------------------------------------------- helpers

    def _schedule(self, output: SchedulerOutput, request: Request, num_new_tokens: int, new_block_ids: list[int],
                  is_new: bool, draft: list[int] | None = None) -> None:
        start = request.num_computed_tokens
        end = start + num_new_tokens
        samples = end == request.num_tokens + len(draft or ())
        forks = self._unforked.get(request.seq_id, []) if samples else []
        output.scheduled.append(ScheduledRequest(request, num_new_tokens, samples, new_block_ids, is_new, forks,
                                                 draft or []))
        output.num_batched_tokens += num_new_tokens
        num_prompt_positions = max(0, min(end, request.num_prompt_tokens) - start)
        self.counters.num_prefill_tokens_computed += num_prompt_positions
        self.counters.num_decode_tokens_computed += num_new_tokens - num_prompt_positions
        if self.fair.num_active > 1:
            self.fair.charge(request.owner, num_prompt_positions, num_new_tokens - num_prompt_positions)

    def _speculates(self) -> bool:
        """Drafts this step: speculation is on and at most ``max_batch`` sequences are decoding."""
        drafter = self.drafter
        if drafter is None or not drafter.config.enabled:
            return False
        num_decoding = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        return 0 < num_decoding <= drafter.config.max_batch

    def _draft(self, request: Request, budget: int, num_behind: int, copies: list[tuple[int, int]]) -> list[int]:
        """A decoding request's draft, its slots already allocated; [] when it has none or they do not fit.
        A draft leaves a free block for each of the ``num_behind`` running requests scheduled after it, so
        drafting never makes one of them preempt another."""
        if request.num_tokens - request.num_computed_tokens != 1:
            return []  # a prefill chunk, or a resumed sequence recomputing its tokens
        assert self.drafter is not None  # (_speculates() said so)
        # Room for every draft token and one more: within the budget, max_new_tokens and max_model_len.
        room = min(budget - 1, request.params.max_new_tokens - len(request.output_token_ids) - 1,
                   self.config.max_model_len - request.num_tokens - 1)
        draft = self.drafter.draft(request, room)
        # Never preempt another sequence for a draft: without free blocks the request decodes plainly.
        if not draft:
            return []
        num_needed = _cdiv(request.num_computed_tokens + 1 + len(draft), self.block_size) - len(request.block_ids)
        if num_needed > 0 and self.block_pool.num_free_blocks - num_needed < num_behind:
            return []
        if not self.blocks.allocate_slots(request, 1 + len(draft), copies=copies):
            return []
        return draft

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        if token_id in self.eos_token_ids and not request.params.ignore_eos:
            return FinishReason.STOP
        if len(request.output_token_ids) >= request.params.max_new_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        self.blocks.release(request)
        self._untold.discard(request.seq_id)  # resumed, it reports its whole table anyway
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.counters.num_preemptions += 1
        output.preempted_request_ids.append(request.seq_id)
        output.ended_request_ids.append(request.seq_id)
        # In front of the waiting requests of its own priority (equal priorities: the queue's front).
        position = 0
        while position < len(self.waiting) and self.waiting[position].priority < request.priority:
            position += 1
        self.waiting.insert(position, request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self._ended_request_ids.append(request.seq_id)
        elif request.status is RequestStatus.UNFORKED and request in self._unforked.get(request.request_id, ()):
            self._unforked[request.request_id].remove(request)  # aborted alone: choice 0 must not fork it
        self.blocks.release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.seq_id]
        self.fair.leave(request.owner)
        self._unforked.pop(request.seq_id, None)
        self._untold.discard(request.seq_id)
        group = self.groups[request.request_id]
        group.remove(request)
        if not group:
            del self.groups[request.request_id]
