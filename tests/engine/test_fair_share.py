"""Fair share between owners in the scheduler: one named test per rule (llm_api/engine/fair_share.py,
llm_api/engine/scheduler.py and llm_api/engine/precedence.py). No model, no torch.

Rules: the least-served owner's request is admitted first; an owner that starts sending is lifted to the
least counter among the active owners; while another owner waits, an owner is capped at its share of the
sequences and the blocks; an owner within its share that lacks room preempts the owner furthest over its
share, never one within it; memory short preempts the owner furthest over its share; a long prompt's chunks
leave room for another owner's first chunk; priorities compare only within an owner, unless a grant
(``SchedulerConfig.priority_grants``: LLM_API_KEY's ``key priority=N``) ranks an owner's requests against the
others' (admitted first, not capped by owners of a worse rank, preempting their sequences, never their
victim; a positive grant puts an owner behind the others); one owner is the scheduler without fair share. (The random operations of tests/engine/test_scheduler.py run with several
owners too.)
"""

from __future__ import annotations

from llm_api.engine.block_pool import BlockPool
from llm_api.engine.fair_share import DECODE_WEIGHT, PREFILL_WEIGHT, FairShare
from llm_api.engine.request import Request
from llm_api.engine.sampling_params import SamplingParams
from llm_api.engine.scheduler import Scheduler
from llm_api.engine.scheduler_config import SchedulerConfig

BLOCK_SIZE = 4


def _scheduler(num_blocks=64, max_num_seqs=8, budget=64, max_model_len=400, grants=None):
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, priority_grants=grants or {}),
                     BlockPool(num_blocks, BLOCK_SIZE), set())


def _request(request_id, owner, prompt_len=4, max_new_tokens=30, priority=0, token=1):
    return Request(request_id, [token] * prompt_len, SamplingParams(max_new_tokens=max_new_tokens),
                   priority=priority, owner=owner)


def _step(scheduler):
    output = scheduler.schedule()
    scheduler.update(output, {s.request.seq_id: 1 for s in output.scheduled if s.samples})
    return output


def _ids(output):
    return [s.request.request_id for s in output.scheduled]


def _running(scheduler, owner):
    return [r.request_id for r in scheduler.running if r.owner == owner]


def test_the_least_served_owner_is_admitted_first():
    # One sequence slot: A queued three requests before B's one; B's goes after A's first, not after all three.
    scheduler = _scheduler(max_num_seqs=1)
    for i in range(3):
        scheduler.add(_request(f"a{i}", "A", max_new_tokens=3))
    scheduler.add(_request("b0", "B", max_new_tokens=3))
    admitted = []
    while scheduler.has_unfinished_requests():
        admitted += [i for i in _ids(_step(scheduler)) if i not in admitted]
    assert admitted == ["a0", "b0", "a1", "a2"]
    # Without owners (one owner, ""): arrival order, as before fair share.
    scheduler = _scheduler(max_num_seqs=1)
    for name in ("a0", "a1", "a2", "b0"):
        scheduler.add(_request(name, "", max_new_tokens=3))
    admitted = []
    while scheduler.has_unfinished_requests():
        admitted += [i for i in _ids(_step(scheduler)) if i not in admitted]
    assert admitted == ["a0", "a1", "a2", "b0"]


def test_counters_weigh_prefill_and_decode_and_a_newcomer_is_lifted_to_the_least_active():
    fair = FairShare(max_num_seqs=8, num_blocks=64)
    fair.join("A", 1)
    fair.charge("A", 100, 10)
    assert fair.served_of("A") == 100 * PREFILL_WEIGHT + 10 * DECODE_WEIGHT
    fair.join("B", 1)  # B did not ask while A was served: it starts level with A, banking nothing
    assert fair.served_of("B") == fair.served_of("A")
    fair.charge("B", 50, 0)
    fair.leave("A")
    fair.join("A", 1)  # back while B is active: max(its own, the least active)
    assert fair.served_of("A") == 100 * PREFILL_WEIGHT + 10 * DECODE_WEIGHT + 50 * PREFILL_WEIGHT
    fair.leave("A")
    fair.leave("B")
    fair.join("B", 1)  # nobody was active: the past is forgotten
    assert fair.served == {"B": 0.0}
    # Through the scheduler, with two owners active: each computed prompt position and decoded token is charged
    # to its owner. (One owner alone is not charged: its counter orders nothing.)
    scheduler = _scheduler()
    scheduler.add(_request("a", "A", prompt_len=12, max_new_tokens=5))
    scheduler.add(_request("b", "B", prompt_len=8, max_new_tokens=5, token=2))
    for _ in range(3):
        _step(scheduler)
    assert scheduler.fair.served_of("A") == 12 * PREFILL_WEIGHT + 2 * DECODE_WEIGHT
    assert scheduler.fair.served_of("B") == 8 * PREFILL_WEIGHT + 2 * DECODE_WEIGHT


def test_an_owner_is_capped_at_its_share_of_sequences_while_another_waits():
    scheduler = _scheduler(max_num_seqs=4)
    for i in range(4):
        scheduler.add(_request(f"a{i}", "A"))
    for i in range(3):
        scheduler.add(_request(f"b{i}", "B"))
    _step(scheduler)
    assert len(_running(scheduler, "A")) == 2 and len(_running(scheduler, "B")) == 2
    # Nobody else waiting: an owner may take every slot (nothing is left idle).
    scheduler = _scheduler(max_num_seqs=4)
    for i in range(4):
        scheduler.add(_request(f"a{i}", "A"))
    _step(scheduler)
    assert len(_running(scheduler, "A")) == 4


def test_an_owner_is_capped_at_its_share_of_blocks_while_another_waits():
    # 16 blocks, two owners: 8 each. Every prompt takes 3 blocks: two of each owner's fit its share, a third
    # does not while the other owner still waits.
    scheduler = _scheduler(num_blocks=16, max_num_seqs=8)
    for i in range(4):
        scheduler.add(_request(f"a{i}", "A", prompt_len=10, token=i + 1))
    for i in range(3):
        scheduler.add(_request(f"b{i}", "B", prompt_len=10, token=i + 10))
    _step(scheduler)
    held = {owner: sum(len(r.block_ids) for r in scheduler.running if r.owner == owner) for owner in "AB"}
    assert held == {"A": 6, "B": 6} and _running(scheduler, "B") == ["b0", "b1"], held
    # B's last request gone: nobody else waits, so A may take the free blocks.
    scheduler.abort("b2")
    _step(scheduler)
    assert len(_running(scheduler, "A")) == 3


def test_an_owner_within_its_share_preempts_the_owner_furthest_over_it():
    scheduler = _scheduler(max_num_seqs=4)
    for i in range(4):
        scheduler.add(_request(f"a{i}", "A", max_new_tokens=50))
    _step(scheduler)
    assert len(_running(scheduler, "A")) == 4
    scheduler.add(_request("b0", "B"))
    output = _step(scheduler)
    assert output.preempted_request_ids == ["a3"] and "b0" in _ids(output)  # A's newest
    # A still holds 3 of 4 slots, over its share of 2: B's second request takes A's newest slot too.
    scheduler.add(_request("b1", "B"))
    output = _step(scheduler)
    assert output.preempted_request_ids == ["a2"] and "b1" in _ids(output)
    # B at its share (2 of 4) waits for a third: A is within its share now, so nothing is preempted.
    scheduler.add(_request("b2", "B"))
    output = _step(scheduler)
    assert not output.preempted_request_ids and "b2" not in _ids(output)
    assert sorted(_running(scheduler, "A")) == ["a0", "a1"] and sorted(_running(scheduler, "B")) == ["b0", "b1"]


def _first_preempted_when_memory_runs_short(owner_a: str, owner_b: str) -> list[str]:
    """12 blocks: a0 and a1 (``owner_a``) came first, b0 (``owner_b``) last; decode until blocks run out."""
    scheduler = _scheduler(num_blocks=12, max_num_seqs=4, budget=64)
    scheduler.add(_request("a0", owner_a, prompt_len=12, max_new_tokens=200))
    scheduler.add(_request("a1", owner_a, prompt_len=12, max_new_tokens=200, token=2))
    _step(scheduler)
    scheduler.add(_request("b0", owner_b, prompt_len=4, max_new_tokens=200, token=3))
    preempted = []
    while not preempted:
        preempted = _step(scheduler).preempted_request_ids
    return preempted


def test_memory_short_preempts_the_owner_furthest_over_its_share():
    # The newest sequence overall is B's, but A holds more than its share (6 blocks), so A's newest goes.
    assert _first_preempted_when_memory_runs_short("A", "B") == ["a1"]
    # One owner: the newest running request goes, as before fair share.
    assert _first_preempted_when_memory_runs_short("", "") == ["b0"]


def test_a_long_prompt_leaves_room_for_another_owners_first_chunk():
    scheduler = _scheduler(budget=32, max_model_len=1000)
    scheduler.add(_request("long", "A", prompt_len=400, max_new_tokens=2))
    _step(scheduler)
    scheduler.add(_request("short", "B", prompt_len=8, max_new_tokens=2, token=2))
    output = _step(scheduler)
    chunks = {s.request.request_id: s.num_new_tokens for s in output.scheduled}
    assert chunks == {"long": 24, "short": 8} and output.scheduled[-1].samples
    # At most half the budget is held back for others (A's prompt still moves).
    scheduler = _scheduler(budget=32, max_model_len=1000)
    scheduler.add(_request("long", "A", prompt_len=400, max_new_tokens=2))
    _step(scheduler)
    scheduler.add(_request("long-b", "B", prompt_len=300, max_new_tokens=2, token=2))
    output = _step(scheduler)
    assert {s.request.request_id: s.num_new_tokens for s in output.scheduled} == {"long": 16, "long-b": 16}
    # One owner: a running prefill takes the budget first, as before fair share.
    scheduler = _scheduler(budget=32, max_model_len=1000)
    scheduler.add(_request("long", "", prompt_len=400, max_new_tokens=2))
    _step(scheduler)
    scheduler.add(_request("short", "", prompt_len=8, max_new_tokens=2, token=2))
    assert _ids(_step(scheduler)) == ["long"]


def test_priorities_compare_only_within_an_owner():
    scheduler = _scheduler(max_num_seqs=2)
    scheduler.add(_request("b-low", "B", priority=5, max_new_tokens=50))
    scheduler.add(_request("a-low", "A", priority=5, max_new_tokens=50))
    _step(scheduler)
    # A's best priority does not preempt B's stream (each holds its share)...
    scheduler.add(_request("a-high", "A", priority=-(2**31)))
    output = _step(scheduler)
    assert "b-low" in _ids(output) and "b-low" not in output.preempted_request_ids
    # ...it preempts A's own worse one.
    assert output.preempted_request_ids == ["a-low"] and "a-high" in _ids(output)


def test_one_owner_takes_everything_and_a_finished_owner_leaves_the_shares():
    scheduler = _scheduler(max_num_seqs=4)
    scheduler.add(_request("b0", "B", max_new_tokens=1))
    for i in range(4):
        scheduler.add(_request(f"a{i}", "A", max_new_tokens=40))
    _step(scheduler)  # b0 ends at its first token
    assert scheduler.fair.num_active == 1
    _step(scheduler)
    assert len(_running(scheduler, "A")) == 4


def test_a_grant_ranks_an_owners_priorities_against_other_owners_and_only_down_to_the_grant():
    scheduler = _scheduler(grants={"G": -10, "Batch": 5})
    for name, owner, priority in (("g-best", "G", -(2**31)), ("g-some", "G", -3), ("g-worse", "G", 7),
                                  ("a-best", "A", -(2**31)), ("batch", "Batch", -(2**31))):
        scheduler.add(_request(name, owner, priority=priority))
    assert {r.request_id: r.rank for r in scheduler.waiting} == {
        "g-best": -10, "g-some": -3, "g-worse": 0, "a-best": 0, "batch": 5}


def test_a_granted_owners_better_rank_is_admitted_first_and_not_capped_by_owners_of_a_worse_rank():
    # One slot: A came first and is the least served, but G's request at priority -1 ranks ahead of it.
    scheduler = _scheduler(max_num_seqs=1, grants={"G": -5})
    scheduler.add(_request("a0", "A", max_new_tokens=3))
    scheduler.add(_request("g0", "G", priority=-1, max_new_tokens=3))
    scheduler.add(_request("g1", "G", priority=0, max_new_tokens=3))
    admitted = []
    while scheduler.has_unfinished_requests():
        admitted += [i for i in _ids(_step(scheduler)) if i not in admitted]
    # (g1 at priority 0 ranks 0 like a0: fair share between them, and A is served less by then)
    assert admitted == ["g0", "a0", "g1"]
    # Four slots, G's three ranked requests take three although A waits (A's rank is worse: no share holds
    # G back); G's request at rank 0 and A's share the last slot by fair share.
    scheduler = _scheduler(max_num_seqs=4, grants={"G": -5})
    for i in range(3):
        scheduler.add(_request(f"a{i}", "A"))
    for i in range(3):
        scheduler.add(_request(f"g{i}", "G", priority=-2))
    _step(scheduler)
    assert sorted(_running(scheduler, "G")) == ["g0", "g1", "g2"] and _running(scheduler, "A") == ["a0"]


def test_a_granted_owners_better_rank_preempts_other_owners_and_is_never_their_shares_victim():
    # Two slots, A and B hold one each (each within its share): G's request at priority -1 takes one of them
    # for its better rank, where fair share alone would have let it wait (nobody is over a share).
    def full(grants):
        scheduler = _scheduler(max_num_seqs=2, grants=grants)
        scheduler.add(_request("a0", "A", max_new_tokens=50))
        scheduler.add(_request("b0", "B", max_new_tokens=50, token=2))
        _step(scheduler)
        scheduler.add(_request("g0", "G", priority=-1, max_new_tokens=50, token=3))
        return _step(scheduler)
    output = full({"G": -5})
    assert len(output.preempted_request_ids) == 1 and "g0" in _ids(output)
    output = full({})
    assert not output.preempted_request_ids and "g0" not in _ids(output)
    # G holds both slots (over its share of one once A waits): A's request within its share does not take
    # G's sequences, which rank better; without the grant it takes G's newest.
    def taken_from_g(grants):
        scheduler = _scheduler(max_num_seqs=2, grants=grants)
        scheduler.add(_request("g0", "G", priority=-1, max_new_tokens=50))
        scheduler.add(_request("g1", "G", priority=-1, max_new_tokens=50, token=2))
        _step(scheduler)
        scheduler.add(_request("a0", "A", max_new_tokens=50, token=3))
        return _step(scheduler).preempted_request_ids
    assert taken_from_g({"G": -5}) == [] and taken_from_g({}) == ["g1"]


def _preempted_when_memory_runs_short(grants):
    """12 blocks: G's g0 and g1 (12-token prompts, over G's share of blocks once B comes), then B's b0 (6
    tokens: its blocks fill on other steps than G's); decode until blocks run out while a G sequence needs one."""
    scheduler = _scheduler(num_blocks=12, max_num_seqs=4, budget=64, grants=grants)
    scheduler.add(_request("g0", "G", prompt_len=12, max_new_tokens=200, priority=-1))
    scheduler.add(_request("g1", "G", prompt_len=12, max_new_tokens=200, priority=-1, token=2))
    _step(scheduler)
    scheduler.add(_request("b0", "B", prompt_len=6, max_new_tokens=200, token=3))
    preempted = []
    while not preempted:
        preempted = _step(scheduler).preempted_request_ids
    return preempted


def test_memory_short_preempts_the_worst_rank_first():
    # G over its share and ranked better: B's sequence goes; without the grant, G's newest (furthest over).
    assert _preempted_when_memory_runs_short({"G": -1}) == ["b0"]
    assert _preempted_when_memory_runs_short({}) == ["g1"]


def test_a_positive_grant_puts_a_batch_owner_behind_the_others():
    scheduler = _scheduler(max_num_seqs=1, grants={"Batch": 1})
    for i in range(2):
        scheduler.add(_request(f"batch{i}", "Batch", max_new_tokens=3))
    scheduler.add(_request("a0", "A", max_new_tokens=3))
    scheduler.add(_request("a1", "A", max_new_tokens=3))
    admitted = []
    while scheduler.has_unfinished_requests():
        admitted += [i for i in _ids(_step(scheduler)) if i not in admitted]
    assert admitted == ["a0", "a1", "batch0", "batch1"]
