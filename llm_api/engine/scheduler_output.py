"""What the scheduler hands the model runner each step (pure Python, no torch): ``SchedulerOutput``.

``schedule()`` returns a ``SchedulerOutput``: per scheduled request, its new tokens, whether it samples,
and the block ids it got this step (``new_block_ids``; all of its blocks when ``is_new``, i.e. admitted or
resumed after preemption), plus the ids of requests that finished or were preempted since the last
output. The model runner keeps its own copy of each request's block table from these deltas (vLLM v1's
shape), so nothing below the scheduler depends on how the scheduler stores its lists.

A request with n > 1 lists the siblings that start from its logits row in ``ScheduledRequest.forks``, and
``block_copies`` names the K/V the runner copies before the forward (copy on write of a shared partial
block); a drafted sequence carries its draft in ``draft_token_ids`` (``llm_api.engine.scheduler`` says when
each happens). These types live apart from the scheduler so that the model runner, the memory profile and
the step-budget probe, which build or read them, import no scheduling rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_api.engine.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    samples: bool  # this step reaches the request's last token, so a new token is sampled for it
    new_block_ids: list[int] = field(default_factory=list)  # blocks it got this step, in table order
    is_new: bool = False  # admitted, resumed, forked or copied on write: new_block_ids is its whole table
    forks: list[Request] = field(default_factory=list)  # siblings that start from this row's logits (n > 1)
    # Speculative decoding: tokens scheduled after the request's last token (num_new_tokens = 1 + len);
    # the runner returns a logits row for each of its 1 + len positions.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)  # seq ids
    # Sequences (seq ids) that left the running set since the previous output (finished, aborted,
    # preempted): the model runner drops its copy of their block tables.
    ended_request_ids: list[str] = field(default_factory=list)
    # (source block, destination block): K/V to copy before this step's forward (copy on write).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

