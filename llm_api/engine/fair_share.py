"""Fair share of the engine between owners (pure Python, no torch): who has been served least, and how
much of the running set and the KV blocks each owner may hold while another waits.

An owner is who sent a request (a key: ``Call.tenant``; everyone is one owner where no key is checked).
The scheduler (``llm_api.engine.scheduler``) asks this module three things:

* **the order**: owners are served least-served first, by a virtual token counter per owner ("Fairness in
  Serving Large Language Models", Sheng et al., OSDI 2024, its VTC): each computed prompt position adds
  ``PREFILL_WEIGHT`` and each decoded token ``DECODE_WEIGHT`` to its owner's counter (a decode step reads
  the whole model for one token; the paper weighs them 1 and 2). An owner that starts sending again while
  others are active is lifted to the least counter among them, so service it did not ask for is never
  banked against the others; when no owner is active, every counter is forgotten.
* **the shares**: with ``k`` owners active (holding unfinished requests), an owner's share is
  ``ceil(max_num_seqs / k)`` running sequences and ``num_blocks / k`` KV blocks. The scheduler caps an
  owner at its share only while another owner waits (no capacity is left idle when only one owner wants
  it), and preempts only sequences of an owner over its share to admit one under it.
* **how far over its share** an owner is (``overshoot``), which picks the owner a preemption takes from.

One owner (the default, and every server without keys) is exactly the scheduler without fair share: its
counter orders nothing, its share is everything.
"""

from __future__ import annotations

PREFILL_WEIGHT = 1.0
DECODE_WEIGHT = 2.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FairShare:
    def __init__(self, max_num_seqs: int, num_blocks: int):
        self.max_num_seqs = max_num_seqs
        self.num_blocks = num_blocks
        self.served: dict[str, float] = {}  # owner -> virtual tokens served (kept while any owner is active)
        self._num_sequences: dict[str, int] = {}  # active owner -> its unfinished sequences

    # ----------------------------------------------------------------- owners in and out

    def join(self, owner: str, num_sequences: int) -> None:
        """``owner`` queued ``num_sequences`` more sequences."""
        if owner not in self._num_sequences:
            if not self._num_sequences:
                self.served.clear()  # (nobody active: nobody's past service matters any more)
            active = [self.served.get(o, 0.0) for o in self._num_sequences]
            self.served[owner] = max(self.served.get(owner, 0.0), min(active, default=0.0))
            self._num_sequences[owner] = 0
        self._num_sequences[owner] += num_sequences

    def leave(self, owner: str) -> None:
        """One of ``owner``'s sequences finished."""
        left = self._num_sequences[owner] - 1
        if left:
            self._num_sequences[owner] = left
        else:
            del self._num_sequences[owner]

    def charge(self, owner: str, num_prefill_tokens: int, num_decode_tokens: int) -> None:
        """Count service given to ``owner``. The scheduler charges only while several owners are active: alone,
        an owner's counter orders nothing, and an owner that joins it is lifted to its counter whatever that
        is, so skipping the count costs nothing and saves a step's bookkeeping."""
        self.served[owner] = (self.served.get(owner, 0.0) + PREFILL_WEIGHT * num_prefill_tokens
                              + DECODE_WEIGHT * num_decode_tokens)

    # ----------------------------------------------------------------- what the scheduler asks

    @property
    def num_active(self) -> int:
        return len(self._num_sequences)

    def served_of(self, owner: str) -> float:
        return self.served.get(owner, 0.0)

    def seq_share(self) -> int:
        return _cdiv(self.max_num_seqs, max(self.num_active, 1))

    def block_share(self) -> int:
        return self.num_blocks // max(self.num_active, 1)

    def within_share(self, num_seqs: int, num_blocks: int) -> bool:
        """An owner holding ``num_seqs`` sequences and ``num_blocks`` blocks (with what it asks for) is within
        its share."""
        return num_seqs <= self.seq_share() and num_blocks <= self.block_share()

    def overshoot(self, num_seqs: int, num_blocks: int) -> float:
        """How far over its share an owner holding this much is: > 1 over it (the larger of the two ratios)."""
        return max(num_seqs / self.seq_share(), num_blocks / max(self.block_share(), 1))
