"""What every response store keeps and promises (``ResponseStore``), and the parts both stores share.

An entry is keyed by the response id and holds its owner (an opaque string: ``llm_api.service.owners``),
the time it was stored, the response object as JSON text (what ``GET /v1/responses/{id}`` returns) and the
conversation that ``previous_response_id`` continues (JSON text too, so its size is known and SQLite holds
it as is).

* ``get`` and ``delete`` answer None / False alike for an id that is unknown, evicted, expired or owned by
  someone else: the caller answers 404 to all of them, so nobody learns that another's id exists.
* Bounds: at most ``max_entries`` entries and ``max_bytes`` bytes in all, and ``owner_max_entries`` /
  ``owner_max_bytes`` for one owner (a quarter of each by default): a put first evicts its own owner's oldest
  entries until that owner is within its quota, then, while the store is still over its bounds, the oldest
  entry of the owner holding the most (bytes when the byte bound bites, else entries): one key's flood of
  large responses pushes out its own history, never a smaller holder's; an entry is gone ``ttl_s`` seconds
  after it was stored (checked on every access and by a periodic sweep, so expired text does not linger on a
  quiet server). An entry costs ``entry_cost``: the UTF-8 bytes of its id, owner and both texts (echoed tools
  and instructions included) plus ``ENTRY_OVERHEAD_BYTES`` (the memory store keeps the texts as UTF-8 bytes,
  so that is what it holds; tests/test_response_store.py measures it).
* An entry larger than ``max_bytes`` or ``owner_max_bytes`` alone, or with text that is not valid Unicode, is
  not stored:
  ``put`` answers False and evicts nothing (but the entry it would have replaced is gone: the route has
  answered already; a later ``get`` is None, as for an evicted one). ``max_entries`` 0 stores nothing.
* Background responses in flight are claimed (``claim_background``: the response id, its owner and the
  process running it, an ``incarnation`` text) until they end (``release_background``);
  ``orphaned_background(alive)`` takes back the claims of processes that are gone (``alive`` says), which a
  starting process marks failed (``llm_api.protocols.responses.state``). In SQLite a second table holds the
  claims, so a crash leaves them for the next start, whichever process on the file that is.
* Thread-safe: one lock per store (the event loop and worker threads call it); the SQLite store also takes
  SQLite's write lock for each change (``BEGIN IMMEDIATE``) and reads its totals again when another
  process wrote the file, so several processes on one file keep the bounds too. Every value reaches SQL
  as a parameter, never formatted into a statement.

Both stores (``.memory``, ``.sqlite``) check ids (``check_id``), compare owners in constant time
(``same_owner``), refuse text that is not valid Unicode (``encodable``), count an entry's bytes alike
(``entry_cost``) and sweep on a daemon thread (``Sweeper``): written once here, so the two cannot drift.
"""

from __future__ import annotations

import hmac
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Protocol

from llm_api.model.settings import Settings

logger = logging.getLogger(__name__)

# Per-entry memory besides its texts, in the memory store (CPython 3.x, 64-bit): the OrderedDict slot and
# link, the row object, its float and int, the four str/bytes headers, and its slot in its owner's index
# (another OrderedDict): about 440 bytes measured with tracemalloc on a grown table, up to about 120 more
# while the two tables hold the dummies of evicted entries (until their next resize).
# tests/test_response_store.py measures both and fails if either outgrows this. SQLite's per-row cost is
# smaller (a few dozen bytes of header and index entries): one constant for both.
ENTRY_OVERHEAD_BYTES = 560
# Ids are made by the service ("resp_" + hex); a longer one given to put is a bug, not an input.
MAX_ID_CHARS = 256

Clock = Callable[[], float]


@dataclass(frozen=True)
class StoreLimits:
    max_entries: int
    max_bytes: int
    ttl_s: float
    owner_max_entries: int | None = None  # None: all of max_entries
    owner_max_bytes: int | None = None  # None: all of max_bytes

    @classmethod
    def from_settings(cls, settings: Settings) -> "StoreLimits":
        return cls(settings.responses_store_max_entries, settings.responses_store_max_bytes,
                   settings.responses_store_ttl_s, settings.responses_store_owner_max_entries,
                   settings.responses_store_owner_max_bytes)

    @property
    def per_owner_entries(self) -> int:
        return self.max_entries if self.owner_max_entries is None else min(self.owner_max_entries, self.max_entries)

    @property
    def per_owner_bytes(self) -> int:
        return self.max_bytes if self.owner_max_bytes is None else min(self.owner_max_bytes, self.max_bytes)


@dataclass(frozen=True)
class StoredResponse:
    response_id: str
    owner: str
    created_at: float  # the store's clock (Unix seconds) when put
    response_json: str
    conversation_json: str


class ResponseStore(Protocol):
    limits: StoreLimits

    def put(self, response_id: str, owner: str, response_json: str, conversation_json: str) -> bool:
        """Store (or replace) an entry, evicting the oldest to make room; False: it alone exceeds the bounds."""

    def get(self, response_id: str, owner: str) -> StoredResponse | None: ...

    def update(self, response_id: str, owner: str, response_json: str, conversation_json: str | None = None) -> bool:
        """Replace an entry's texts (a background response finished or was cancelled), keeping its place and
        time; False when ``get`` would be None. An update that no longer fits removes the entry."""

    def delete(self, response_id: str, owner: str) -> bool: ...

    def sweep(self) -> int:
        """Remove expired entries; how many."""

    def stats(self) -> tuple[int, int]:
        """(entries, bytes) held now."""

    def claim_background(self, response_id: str, owner: str, incarnation: str) -> None:
        """A background response of ``owner`` runs in the process ``incarnation`` (module docstring)."""

    def release_background(self, response_id: str) -> None: ...

    def orphaned_background(self, alive: Callable[[str], bool]) -> list[tuple[str, str]]:
        """(response id, owner) of each claim whose process is not ``alive``; those claims are removed."""

    def close(self) -> None: ...


def entry_cost(response_id: str, owner: str, response: bytes, conversation: bytes) -> int:
    return (len(response_id.encode("utf-8", "surrogatepass")) + len(owner.encode("utf-8", "surrogatepass"))
            + len(response) + len(conversation) + ENTRY_OVERHEAD_BYTES)


def check_id(response_id: str) -> None:
    if not response_id or len(response_id) > MAX_ID_CHARS:
        raise ValueError(f"a stored response's id must have 1 to {MAX_ID_CHARS} characters, not {len(response_id)}")


def same_owner(stored: str, given: str) -> bool:
    return hmac.compare_digest(stored.encode("utf-8", "surrogatepass"), given.encode("utf-8", "surrogatepass"))


def encodable(*texts: str) -> bool:
    """Whether every text is valid Unicode (a lone surrogate is not, and cannot be UTF-8 or an SQLite
    parameter): ``put`` stores no such text (JSON written with ``ensure_ascii``, json.dumps's default, never
    holds one), and an id holding one was never stored, so it is unknown."""
    try:
        for text in texts:
            text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Sweeper:
    """A daemon thread calling ``sweep`` every ``every_s`` seconds until stopped."""

    def __init__(self, sweep: Callable[[], int], every_s: float):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sweep, every_s), name="response-store-sweep",
                                        daemon=True)
        self._thread.start()

    def _run(self, sweep: Callable[[], int], every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                sweep()
            except Exception:  # a failed sweep (a locked or full disk) must not end the sweeping
                logger.exception("response store: the periodic sweep failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
