"""Who gives way to whom in the scheduler (pure Python, no torch): the rules that take sequence slots, KV
blocks or a step's tokens from running sequences for others.

``Precedence`` holds them as methods of the scheduler: ``llm_api.engine.scheduler.Scheduler`` derives from
it, and it declares the scheduler state the rules read and change (they run inside ``schedule()`` and
preempt through the scheduler's ``_preempt``). Ranks, priorities,
owners and shares are as the scheduler's docstring and ``llm_api.engine.fair_share`` define them; the
running set is in the scheduler's order (best rank first, then least-served owner, then priority;
admission order within one), so its last sequence is the first to give way.

* ``_preempt_for_priority``: the first waiting request (the best rank, then the best priority) that lacks
  a sequence slot or the blocks for its first chunk preempts running sequences worse than it, worst and
  newest first, until it has them: its own owner's of a worse priority and any owner's of a worse rank,
  never another owner's for a priority alone.
* ``_preempt_for_share``: with several owners active, the least-served waiting owner of the best rank whose
  next request would leave it within its share, but which lacks room, takes it from the owner furthest over
  its share (that owner's newest sequences of the waiting request's rank or a worse one), never from an
  owner within its share.
* ``_victim``: memory short while a running sequence is scheduled, the one that gives way: among those not
  yet scheduled this step of the worst rank, the newest of the owner furthest over its share.
* ``_reservations``: per owner, the tokens its prefill chunks leave this step to the first chunks of other
  owners' waiting requests that rank better, or as well and were served no more, within their share (at
  most half the budget), so an owner's long prompts never crowd out another owner's admission.

The queries they share (``_waiting_heads``, ``_usage``, ``_needs``, ``_num_running_seqs``, ``_lora_blocked``)
serve the scheduler's admission too. With one owner and every priority equal, only ``_victim`` acts, and
it picks the newest running sequence: the scheduler's plain first-come order.
"""

from __future__ import annotations

from collections import Counter, deque

from llm_api.engine.block_pool import BlockPool
from llm_api.engine.fair_share import FairShare
from llm_api.engine.request import Request
from llm_api.engine.scheduler_config import SchedulerConfig
from llm_api.engine.scheduler_output import SchedulerOutput
from llm_api.engine.sequence_blocks import SequenceBlocks


class Precedence:
    """The rules above, as methods of the scheduler (module docstring)."""

    # The scheduler state the rules read and change (set by Scheduler.__init__).
    config: SchedulerConfig
    block_pool: BlockPool
    block_size: int
    blocks: SequenceBlocks
    fair: FairShare
    waiting: deque[Request]
    running: list[Request]
    _unforked: dict[str, list[Request]]

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        raise NotImplementedError  # Scheduler._preempt: back to the waiting queue, its blocks freed

    def _preempt_for_priority(self, output: SchedulerOutput) -> None:
        """Preempt running sequences worse than the first waiting request (the best rank, then the best
        priority: with one owner, the queue's first), worst and newest first, while it lacks a sequence slot or
        the blocks for its first chunk: its owner's of a worse priority and any owner's of a worse rank; nothing
        when none is worse. Priorities compare only within an owner: a key's priority never preempts another
        key's sequences unless a grant gave it a better rank. (A request held back by MAX_LORAS is left to
        wait.)"""
        if not self.waiting or not self.running:
            return
        head = min(self._waiting_heads().values(), key=lambda r: (r.rank, r.priority))
        worse = [r for r in self.running
                 if r.rank > head.rank or (r.owner == head.owner and r.priority > head.priority)]
        if not worse:
            return
        if self._lora_blocked(head, {r.lora_id for r in self.running if r.lora_id}):
            return
        num_blocks, num_seqs = self._needs(head)
        while worse:  # (running is in rank order, and in priority order within an owner: the last is the worst)
            if (self._num_running_seqs() + num_seqs <= self.config.max_num_seqs
                    and num_blocks <= self.block_pool.num_free_blocks):
                return
            victim = worse.pop()
            self.running.remove(victim)
            self._preempt(victim, output)

    def _preempt_for_share(self, output: SchedulerOutput) -> None:
        """With several owners active: the least-served waiting owner of the best rank whose next request would
        leave it within its share, but which lacks a sequence slot or the blocks for its first chunk, gets them
        from the owner furthest over its share (that owner's newest sequences of the waiting request's rank or
        a worse one first), never from an owner within its share."""
        fair = self.fair
        if fair.num_active < 2 or not self.waiting or not self.running:
            return
        heads = self._waiting_heads()
        running_loras = {r.lora_id for r in self.running if r.lora_id}
        usage = self._usage()
        for owner in sorted(heads, key=lambda o: (heads[o].rank, fair.served_of(o))):
            head = heads[owner]
            if self._lora_blocked(head, running_loras):
                continue
            num_blocks, num_seqs = self._needs(head)
            held_seqs, held_blocks = usage.get(owner, (0, 0))
            if not fair.within_share(held_seqs + num_seqs, held_blocks + num_blocks):
                continue
            while not (self._num_running_seqs() + num_seqs <= self.config.max_num_seqs
                       and num_blocks <= self.block_pool.num_free_blocks):
                over = [(fair.overshoot(*held), o) for o, held in usage.items() if o != owner]
                worst, victim_owner = max(over, default=(0.0, ""))
                if worst <= 1:
                    return  # nobody is over its share: the owner waits like anyone
                victim = next((r for r in reversed(self.running) if r.owner == victim_owner and r.rank >= head.rank),
                              None)
                if victim is None:
                    return  # what that owner holds ranks better than the waiting request
                self.running.remove(victim)
                victim_seqs = 1 + len(self._unforked.get(victim.seq_id, ()))
                held = usage[victim_owner]
                usage[victim_owner] = (held[0] - victim_seqs, held[1] - len(victim.block_ids))
                self._preempt(victim, output)
            return

    def _victim(self, index: int) -> Request:
        """The sequence to preempt when memory is short while ``running[index]`` is being scheduled: among those
        not yet scheduled this step (``running[index:]``) of the worst rank, the newest of the owner furthest
        over its share; with one owner, the last one (the newest of the worst priority)."""
        if self.fair.num_active < 2:
            return self.running[-1]
        worst_rank = max(r.rank for r in self.running[index:])
        candidates = [r for r in self.running[index:] if r.rank == worst_rank]
        usage = self._usage()
        owner = max({r.owner for r in candidates}, key=lambda o: self.fair.overshoot(*usage[o]))
        return next(r for r in reversed(candidates) if r.owner == owner)

    def _reservations(self) -> dict[str, int]:
        """With several owners active: per owner, the tokens its prefill chunks leave this step to the first
        chunks of other owners' waiting requests, those of owners of a better rank, or of its rank and served no
        more than it, within their share (at most half the budget). Empty when nobody waits or one owner is
        active."""
        fair = self.fair
        if fair.num_active < 2 or not self.waiting:
            return {}
        heads = self._waiting_heads()
        usage = self._usage()
        wanted: list[tuple[tuple[int, float], str, int]] = []
        for owner, head in heads.items():
            held_seqs, held_blocks = usage.get(owner, (0, 0))
            num_blocks, num_seqs = self._needs(head)
            if fair.within_share(held_seqs + num_seqs, held_blocks + num_blocks):
                wanted.append(((head.rank, fair.served_of(owner)), owner, head.num_tokens))
        half = self.config.max_num_batched_tokens // 2
        running_ranks: dict[str, int] = {}
        for request in self.running:
            running_ranks[request.owner] = min(request.rank, running_ranks.get(request.owner, request.rank))
        reserved = {}
        for owner, rank in running_ranks.items():
            standing = (rank, fair.served_of(owner))
            reserved[owner] = min(half, sum(tokens for s, o, tokens in wanted if o != owner and s <= standing))
        return {owner: tokens for owner, tokens in reserved.items() if tokens}

    def _waiting_heads(self) -> dict[str, Request]:
        """Each owner's first waiting request (the queue is in each owner's own order)."""
        heads: dict[str, Request] = {}
        for waiting in self.waiting:
            heads.setdefault(waiting.owner, waiting)
        return heads

    def _usage(self) -> dict[str, tuple[int, int]]:
        """Each owner's running sequences (with the siblings its choice 0s will fork) and the blocks they hold."""
        seqs: Counter[str] = Counter()
        blocks: Counter[str] = Counter()
        for request in self.running:
            seqs[request.owner] += 1 + len(self._unforked.get(request.seq_id, ()))
            blocks[request.owner] += len(request.block_ids)
        return {owner: (seqs[owner], blocks[owner]) for owner in seqs}

    def _needs(self, request: Request) -> tuple[int, int]:
        """(blocks, sequence slots) a waiting request needs to be admitted with its first chunk."""
        hit_block_ids = self.blocks.find_cached_blocks(request)
        num_new_tokens = min(request.num_tokens - len(hit_block_ids) * self.block_size,
                             self.config.max_num_batched_tokens)
        return (sum(self.blocks.blocks_to_take(request, num_new_tokens, hit_block_ids)),
                1 + len(self._unforked.get(request.seq_id, ())))

    def _num_running_seqs(self) -> int:
        """Running sequences, with the siblings a running choice 0 still prefilling will fork."""
        return len(self.running) + sum(len(self._unforked.get(r.seq_id, ())) for r in self.running)

    def _lora_blocked(self, request: Request, running_loras: set[int]) -> bool:
        """The request's adapter cannot join: MAX_LORAS other adapters run (``running_loras``: their ids)."""
        return bool(request.lora_id) and request.lora_id not in running_loras and \
            len(running_loras) >= self.config.max_loras
