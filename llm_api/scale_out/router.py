"""Ray Serve's request router for the model replicas: to the replica that holds the prompt's prefix while
load is balanced, else to the less loaded of two (``RequestRouter``, Ray Serve's routing API).

The policy, for each request (``Forwarded.affinity``: ``llm_api.scale_out.affinity.affinity_text``):

1. Candidates: every running replica, narrowed first by Ray's multiplexing rule when the request names an
   adapter (``MultiplexMixin``: the replicas holding it, else those holding the fewest adapters;
   ``llm_api.scale_out.deployments``).
2. The holder: the candidate whose remembered prompts share the longest prefix with this one
   (``PrefixIndex``). It is chosen when the shared prefix is at least ``min_match_chars`` characters
   (default 256, ~64 tokens: less is not worth a queue) **and** it has at most ``imbalance`` more requests
   in flight than the least-loaded candidate (default 4: past that, waiting costs more than a prefill of
   the prefix saves on a small host; raise it on a big one). The rest follow as a second rank, so a holder
   that refuses (at ``max_ongoing_requests``) sends the request to the least loaded of them.
3. Otherwise two candidates at random, and Ray takes the less loaded (power of two choices): a new prefix
   lands on a lightly loaded replica, which then becomes its holder.

The router instance lives in the process that calls the replicas (the ingress replica: run one per node);
its index learns from what it routed (``on_request_routed``) and forgets a replica that died. Several
ingress replicas each keep their own index, which still converges: each sends a prefix where it sent it
before. Loads are Ray's cached queue lengths (probed when missing or stale).
"""

from __future__ import annotations

import logging
import random
from typing import Any

from ray.serve.request_router import FIFOMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from llm_api.scale_out.affinity import DEFAULT_MAX_BLOCKS, PrefixIndex

logger = logging.getLogger(__name__)

DEFAULT_IMBALANCE = 4
DEFAULT_MIN_MATCH_CHARS = 256


def affinity_of(pending_request: PendingRequest | None) -> str:
    """The routing text a forwarded request carries (its first argument's ``affinity``), else ''."""
    if pending_request is None or not pending_request.args:
        return ""
    text = getattr(pending_request.args[0], "affinity", "")
    return text if isinstance(text, str) else ""


class PrefixAffinityRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, min_match_chars: int = DEFAULT_MIN_MATCH_CHARS,
                         max_blocks: int = DEFAULT_MAX_BLOCKS, affinity: bool = True, **_: Any) -> None:
        """``affinity`` False: step 3 alone (``llm_api serve --ray --routing random``, the baseline of
        bench/scale_out.py)."""
        self.affinity = affinity
        self.imbalance = imbalance
        self.min_match_chars = min_match_chars
        self.index = PrefixIndex(max_blocks)

    def _load(self, replica: RunningReplica) -> int:
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        candidates = candidate_replicas
        if pending_request is not None and pending_request.metadata.multiplexed_model_id:
            wanted = self.apply_multiplex_routing(pending_request=pending_request)
            candidates = [replica for replica in candidate_replicas if replica.replica_id in wanted]
        if not candidates:
            return []
        text = affinity_of(pending_request) if self.affinity else ""
        if text:
            matched = self.index.match(text, [replica.replica_id for replica in candidates])
            holder = max(candidates, key=lambda r: (matched[r.replica_id], -self._load(r)))
            lightest = min(self._load(replica) for replica in candidates)
            if matched[holder.replica_id] >= self.min_match_chars and self._load(holder) - lightest <= self.imbalance:
                rest = sorted((r for r in candidates if r is not holder), key=self._load)
                return [[holder], rest] if rest else [[holder]]
        return [random.sample(candidates, min(2, len(candidates)))]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        text = affinity_of(pending_request) if self.affinity else ""
        if text:
            self.index.insert(text, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {replica.replica_id for replica in replicas}
        for gone in [replica for replica in self.index.replicas() if replica not in alive]:
            self.index.forget(gone)
