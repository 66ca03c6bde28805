"""The memory store (the default, RESPONSES_STORE_PATH empty): stored responses in this process, gone at restart.

``MemoryResponseStore`` keeps the contract of ``.interface`` with one lock and plain dicts: the entries in
the order stored (eviction and expiry take from the front), each owner's ids in the same order, and the
byte totals the bounds need, kept with each change. An entry's texts are held as UTF-8 bytes, which is what
``entry_cost`` counts (``ENTRY_OVERHEAD_BYTES`` is measured on this store). Background claims are a dict:
they end with the process, as the responses they name do.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable

from llm_api.protocols.responses.store.interface import (
    Clock,
    StoredResponse,
    StoreLimits,
    Sweeper,
    check_id,
    encodable,
    entry_cost,
    same_owner,
)


class _Row:
    __slots__ = ("owner", "created_at", "response", "conversation", "cost")

    def __init__(self, owner: str, created_at: float, response: bytes, conversation: bytes, cost: int):
        self.owner = owner
        self.created_at = created_at
        self.response = response
        self.conversation = conversation
        self.cost = cost


class MemoryResponseStore:
    """Entries in an OrderedDict in the order stored: eviction and expiry take from its front."""

    def __init__(self, limits: StoreLimits, clock: Clock = time.time, sweep_every_s: float | None = None):
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._rows: OrderedDict[str, _Row] = OrderedDict()
        self._num_bytes = 0
        self._owned: dict[str, OrderedDict[str, None]] = {}  # owner -> its ids, oldest first
        self._owner_bytes: dict[str, int] = {}
        self._claims: dict[str, tuple[str, str]] = {}  # background response id -> (owner, incarnation)
        self._sweeper = Sweeper(self.sweep, sweep_every_s) if sweep_every_s else None

    def put(self, response_id: str, owner: str, response_json: str, conversation_json: str) -> bool:
        check_id(response_id)
        if not encodable(response_id, owner, response_json, conversation_json):
            return False
        response, conversation = response_json.encode(), conversation_json.encode()
        cost = entry_cost(response_id, owner, response, conversation)
        limits = self.limits
        with self._lock:
            self._remove_locked(response_id)  # a replaced entry goes to the back, as a new one
            if cost > limits.per_owner_bytes or limits.max_entries == 0:
                return False
            now = self._clock()
            self._expire_locked(now)
            own = self._owned.get(owner, OrderedDict())
            while own and (len(own) >= limits.per_owner_entries
                           or self._owner_bytes.get(owner, 0) + cost > limits.per_owner_bytes):
                self._remove_locked(next(iter(own)))
            while self._rows and (len(self._rows) >= limits.max_entries or self._num_bytes + cost > limits.max_bytes):
                self._remove_locked(self._largest_holders_oldest_locked(self._num_bytes + cost > limits.max_bytes, owner))
            self._rows[response_id] = _Row(owner, now, response, conversation, cost)
            self._owned.setdefault(owner, OrderedDict())[response_id] = None
            self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + cost
            self._num_bytes += cost
            return True

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        with self._lock:
            row = self._live_locked(response_id, owner)
            if row is None:
                return None
            # Taken together under the lock: an update replaces both texts at once.
            owner, created_at, response, conversation = row.owner, row.created_at, row.response, row.conversation
        return StoredResponse(response_id, owner, created_at, response.decode(), conversation.decode())

    def update(self, response_id: str, owner: str, response_json: str, conversation_json: str | None = None) -> bool:
        if not encodable(response_json, conversation_json or ""):
            return False
        response = response_json.encode()
        with self._lock:
            row = self._live_locked(response_id, owner)
            if row is None:
                return False
            conversation = row.conversation if conversation_json is None else conversation_json.encode()
            cost = entry_cost(response_id, owner, response, conversation)
            if cost > self.limits.per_owner_bytes:
                self._remove_locked(response_id)
                return False
            self._num_bytes += cost - row.cost
            self._owner_bytes[row.owner] += cost - row.cost
            row.response, row.conversation, row.cost = response, conversation, cost
            own = self._owned[row.owner]
            while self._owner_bytes[row.owner] > self.limits.per_owner_bytes:  # never this entry: it fits alone
                self._remove_locked(next(key for key in own if key != response_id))
            while self._num_bytes > self.limits.max_bytes:
                self._remove_locked(self._largest_holders_oldest_locked(True, row.owner, keep=response_id))
            return True

    def delete(self, response_id: str, owner: str) -> bool:
        with self._lock:
            if self._live_locked(response_id, owner) is None:
                return False
            self._remove_locked(response_id)
            return True

    def sweep(self) -> int:
        with self._lock:
            return self._expire_locked(self._clock())

    def stats(self) -> tuple[int, int]:
        with self._lock:
            return len(self._rows), self._num_bytes

    def claim_background(self, response_id: str, owner: str, incarnation: str) -> None:
        with self._lock:
            self._claims[response_id] = (owner, incarnation)

    def release_background(self, response_id: str) -> None:
        with self._lock:
            self._claims.pop(response_id, None)

    def orphaned_background(self, alive: Callable[[str], bool]) -> list[tuple[str, str]]:
        with self._lock:
            gone = [(rid, owner) for rid, (owner, incarnation) in self._claims.items() if not alive(incarnation)]
            for rid, _ in gone:
                del self._claims[rid]
            return gone

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.stop()
        with self._lock:
            self._claims.clear()
            self._rows.clear()
            self._owned.clear()
            self._owner_bytes.clear()
            self._num_bytes = 0

    def _live_locked(self, response_id: str, owner: str) -> _Row | None:
        row = self._rows.get(response_id)
        if row is None:
            return None
        if row.created_at + self.limits.ttl_s <= self._clock():
            self._remove_locked(response_id)
            return None
        return row if same_owner(row.owner, owner) else None

    def _expire_locked(self, now: float) -> int:
        # Stored in time order, so the expired ones are at the front (a clock set back only delays them:
        # every access still checks its own entry's age).
        removed = 0
        while self._rows:
            oldest_id, oldest = next(iter(self._rows.items()))
            if oldest.created_at + self.limits.ttl_s > now:
                break
            self._remove_locked(oldest_id)
            removed += 1
        return removed

    def _largest_holders_oldest_locked(self, by_bytes: bool, writer: str, keep: str | None = None) -> str:
        """The oldest entry (never ``keep``) of the owner holding the most bytes (``by_bytes``) or entries; on a
        tie the writer's own, then the owner with the oldest entry."""
        def rank(owner: str) -> tuple[int, bool, float]:
            ids = self._owned[owner]
            if keep in ids and len(ids) == 1:
                return (-1, False, 0.0)  # (its one entry is the one kept)
            return (self._owner_bytes[owner] if by_bytes else len(ids), owner == writer,
                    -self._rows[next(iter(ids))].created_at)

        largest = max(self._owned, key=rank)
        return next(key for key in self._owned[largest] if key != keep)

    def _remove_locked(self, response_id: str) -> None:
        row = self._rows.pop(response_id, None)
        if row is not None:
            self._num_bytes -= row.cost
            own = self._owned[row.owner]
            del own[response_id]
            self._owner_bytes[row.owner] -= row.cost
            if not own:
                del self._owned[row.owner], self._owner_bytes[row.owner]
