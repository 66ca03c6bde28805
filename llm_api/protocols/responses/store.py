"""Stored responses: what the Responses API keeps for ``store: true`` (OpenAI's default), bounded.

One interface (``ResponseStore``), two stores: ``MemoryResponseStore`` (the default: gone at restart) and
``SqliteResponseStore`` (``RESPONSES_STORE_PATH``: one SQLite file, so stored responses survive a restart
and the TorchServe workers of one model share them). ``open_response_store(settings)`` picks one.

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
"""

from __future__ import annotations

import hmac
import logging
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

from llm_api.model.settings import ConfigError, Settings

logger = logging.getLogger(__name__)

# Per-entry memory besides its texts, in the memory store (CPython 3.x, 64-bit): the OrderedDict slot and
# link, the row object, its float and int, the four str/bytes headers, and its slot in its owner's index
# (another OrderedDict): about 440 bytes measured with tracemalloc on a grown table, up to about 120 more
# while the two tables hold the dummies of evicted entries (until their next resize).
# tests/test_response_store.py measures both and fails if either outgrows this. SQLite's per-row cost is
# smaller (a few dozen bytes of header and index entries): one constant for both.
ENTRY_OVERHEAD_BYTES = 560
# The SQLite file holds about its counted bytes (0.5x to 1.2x measured, entries of 100 B to 100 KB: pages
# left part empty by rows of about 3 KB are the most), plus its write-ahead log, cut back to this after
# each checkpoint (SQLite checkpoints at 1,000 pages, 4 MiB).
WAL_LIMIT_BYTES = 4 << 20
# Ids are made by the service ("resp_" + hex); a longer one given to put is a bug, not an input.
MAX_ID_CHARS = 256
# How often the periodic sweep runs at most (and at least once per TTL).
SWEEP_EVERY_S = 60.0

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


def _check_id(response_id: str) -> None:
    if not response_id or len(response_id) > MAX_ID_CHARS:
        raise ValueError(f"a stored response's id must have 1 to {MAX_ID_CHARS} characters, not {len(response_id)}")


def _same_owner(stored: str, given: str) -> bool:
    return hmac.compare_digest(stored.encode("utf-8", "surrogatepass"), given.encode("utf-8", "surrogatepass"))


class _Sweeper:
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
        self._sweeper = _Sweeper(self.sweep, sweep_every_s) if sweep_every_s else None

    def put(self, response_id: str, owner: str, response_json: str, conversation_json: str) -> bool:
        _check_id(response_id)
        if not _encodable(response_id, owner, response_json, conversation_json):
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
        if not _encodable(response_json, conversation_json or ""):
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
        return row if _same_owner(row.owner, owner) else None

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


SCHEMA = """
CREATE TABLE IF NOT EXISTS stored_responses (
    seq INTEGER PRIMARY KEY,
    response_id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    cost INTEGER NOT NULL,
    response_json TEXT NOT NULL,
    conversation_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS stored_responses_by_age ON stored_responses (created_at, cost);
CREATE INDEX IF NOT EXISTS stored_responses_by_owner ON stored_responses (owner, seq, cost);
CREATE TABLE IF NOT EXISTS background_claims (
    response_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    incarnation TEXT NOT NULL
);
"""
TABLES = {"stored_responses", "background_claims"}
COLUMNS = ("seq", "response_id", "owner", "created_at", "cost", "response_json", "conversation_json")
# The deletions, each as (count its rows and bytes, delete them), one parameter each.
REMOVALS = {
    "response_id": ("SELECT COUNT(*), TOTAL(cost) FROM stored_responses WHERE response_id = ?",
                    "DELETE FROM stored_responses WHERE response_id = ?"),
    "seq": ("SELECT COUNT(*), TOTAL(cost) FROM stored_responses WHERE seq = ?",
            "DELETE FROM stored_responses WHERE seq = ?"),
    "stored_before": ("SELECT COUNT(*), TOTAL(cost) FROM stored_responses WHERE created_at <= ?",
                      "DELETE FROM stored_responses WHERE created_at <= ?"),
}


class SqliteResponseStore:
    """One table in one SQLite file (WAL). ``seq`` orders the entries as stored (oldest first).

    The totals the bounds need (entries, bytes) are kept with each change, inside the write transaction
    that makes it, and read again from the table (a scan of the (created_at, cost) index) only when
    another connection has written the file since (SQLite's ``data_version``): so a put costs what it
    evicts, not what the store holds, and several processes on one file still count each other's entries.

    Raises ConfigError naming RESPONSES_STORE_PATH when the file cannot be opened or holds another table."""

    def __init__(self, path: str | Path, limits: StoreLimits, clock: Clock = time.time,
                 sweep_every_s: float | None = None, busy_timeout_s: float = 10.0):
        self.limits = limits
        self.path = Path(path)
        self._clock = clock
        self._busy_timeout_s = busy_timeout_s  # how long a change waits for another process's write
        self._lock = threading.Lock()
        # [entries, bytes] as of data_version ``_seen_version`` of this connection; None: read them again.
        self._totals: list[int] | None = None
        self._seen_version = -1
        try:
            self._db = self._open(self.path)
        except (OSError, sqlite3.Error) as err:
            raise ConfigError(f"RESPONSES_STORE_PATH={str(path)!r} cannot be opened as the response store: "
                              f"{err}") from err
        self._sweeper = _Sweeper(self.sweep, sweep_every_s) if sweep_every_s else None

    def _open(self, path: Path) -> sqlite3.Connection:
        # A file that is there already is read (read-only) before anything is written or its mode changed: one
        # that is not this store's (not SQLite, or a database holding other tables) is refused untouched.
        if path.exists() and not path.is_dir() and path.stat().st_size:
            _check_foreign(path)
        # Made (or narrowed) to 0600 before SQLite opens it: stored conversations are the users' text, and
        # SQLite gives its -wal and -shm files the database file's mode.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
        # isolation_level=None: no implicit transactions; each change opens its own BEGIN IMMEDIATE.
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=self._busy_timeout_s)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a power cut may lose the last entries only
            db.execute("PRAGMA secure_delete=ON")  # a deleted conversation is overwritten, not left in free pages
            db.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")  # the WAL shrinks back after a checkpoint
            db.executescript(SCHEMA)
            found = tuple(row[1] for row in db.execute("PRAGMA table_info(stored_responses)"))
            if found != COLUMNS:
                raise sqlite3.DatabaseError(f"its stored_responses table has columns {found}, expected {COLUMNS}")
            self._db = db
            with self._lock, self._changing():
                # The bounds may have shrunk since the file was written.
                self._expire(self._clock())
                self._make_room(0, None)
        except BaseException:
            db.close()
            raise
        return db

    def put(self, response_id: str, owner: str, response_json: str, conversation_json: str) -> bool:
        _check_id(response_id)
        if not _encodable(response_id, owner, response_json, conversation_json):
            return False
        cost = entry_cost(response_id, owner, response_json.encode(), conversation_json.encode())
        try:
            with self._lock, self._changing() as db:
                self._remove("response_id", response_id)
                if cost > self.limits.per_owner_bytes or self.limits.max_entries == 0:
                    return False
                now = self._clock()
                self._expire(now)
                self._make_room(cost, owner)
                db.execute("INSERT INTO stored_responses (response_id, owner, created_at, cost, response_json, "
                           "conversation_json) VALUES (?, ?, ?, ?, ?, ?)",
                           (response_id, owner, now, cost, response_json, conversation_json))
                self._count(1, cost)
                return True
        except sqlite3.OperationalError:
            # A full disk, or the file locked by another process past the timeout: the answer has gone out
            # already, so this entry is lost like an evicted one (said in the log) and serving goes on.
            logger.exception("response store: could not store a response in %s", self.path)
            return False

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        if not _encodable(response_id, owner):
            return None
        with self._lock:
            row = self._db.execute("SELECT owner, created_at, response_json, conversation_json FROM stored_responses "
                                   "WHERE response_id = ?", (response_id,)).fetchone()
            if row is None:
                return None
            if row[1] + self.limits.ttl_s <= self._clock():
                with self._changing():
                    self._expire(self._clock())
                return None
        if not _same_owner(row[0], owner):
            return None
        return StoredResponse(response_id, row[0], row[1], row[2], row[3])

    def update(self, response_id: str, owner: str, response_json: str, conversation_json: str | None = None) -> bool:
        if not _encodable(response_id, owner, response_json, conversation_json or ""):
            return False
        with self._lock, self._changing() as db:
            self._expire(self._clock())
            row = db.execute("SELECT seq, owner, cost, conversation_json FROM stored_responses WHERE response_id = ?",
                             (response_id,)).fetchone()
            if row is None or not _same_owner(row[1], owner):
                return False
            seq, _, old_cost, old_conversation = row
            conversation = old_conversation if conversation_json is None else conversation_json
            cost = entry_cost(response_id, owner, response_json.encode(), conversation.encode())
            if cost > self.limits.per_owner_bytes:
                self._remove("seq", seq)
                return False
            db.execute("UPDATE stored_responses SET cost = ?, response_json = ?, conversation_json = ? WHERE seq = ?",
                       (cost, response_json, conversation, seq))
            self._count(0, cost - old_cost)
            self._make_room(0, row[1], keep_seq=seq)
            return True

    def delete(self, response_id: str, owner: str) -> bool:
        if not _encodable(response_id, owner):
            return False
        with self._lock, self._changing() as db:
            self._expire(self._clock())
            row = db.execute("SELECT seq, owner FROM stored_responses WHERE response_id = ?",
                             (response_id,)).fetchone()
            if row is None or not _same_owner(row[1], owner):
                return False
            self._remove("seq", row[0])
            return True

    def sweep(self) -> int:
        with self._lock, self._changing():
            return self._expire(self._clock())

    def claim_background(self, response_id: str, owner: str, incarnation: str) -> None:
        if not _encodable(response_id, owner, incarnation):
            return
        try:
            with self._lock, self._changing() as db:
                db.execute("INSERT OR REPLACE INTO background_claims (response_id, owner, incarnation) "
                           "VALUES (?, ?, ?)", (response_id, owner, incarnation))
        except sqlite3.OperationalError:  # (as for put: the response runs on; a crash would leave it queued)
            logger.exception("response store: could not claim a background response in %s", self.path)

    def release_background(self, response_id: str) -> None:
        if not _encodable(response_id):
            return
        try:
            with self._lock, self._changing() as db:
                db.execute("DELETE FROM background_claims WHERE response_id = ?", (response_id,))
        except sqlite3.OperationalError:  # (the next start finds the claim's process gone and marks it failed)
            logger.exception("response store: could not release a background response in %s", self.path)

    def orphaned_background(self, alive: Callable[[str], bool]) -> list[tuple[str, str]]:
        with self._lock, self._changing() as db:
            rows = db.execute("SELECT response_id, owner, incarnation FROM background_claims").fetchall()
            gone = [(rid, owner) for rid, owner, incarnation in rows if not alive(incarnation)]
            db.executemany("DELETE FROM background_claims WHERE response_id = ?", [(rid,) for rid, _ in gone])
            return gone

    def stats(self) -> tuple[int, int]:
        """Read from the table (a scan of its index): for tests and gauges, not for every request."""
        with self._lock:
            count, num_bytes = self._db.execute("SELECT COUNT(*), TOTAL(cost) FROM stored_responses").fetchone()
        return count, int(num_bytes)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.stop()
        with self._lock:
            self._db.close()

    @contextmanager
    def _changing(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (SQLite's write lock, so no other process writes meanwhile), with the totals
        current inside it; committed when the block ends, rolled back (and the totals forgotten) on error."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        committed = False
        try:
            version = db.execute("PRAGMA data_version").fetchone()[0]
            if self._totals is None or version != self._seen_version:
                count, num_bytes = db.execute("SELECT COUNT(*), TOTAL(cost) FROM stored_responses").fetchone()
                self._totals, self._seen_version = [count, int(num_bytes)], version
            yield db
            db.execute("COMMIT")
            committed = True
        finally:
            if not committed:
                self._totals = None
                if db.in_transaction:
                    db.execute("ROLLBACK")

    def _count(self, num_entries: int, num_bytes: int) -> None:
        assert self._totals is not None  # inside _changing
        self._totals[0] += num_entries
        self._totals[1] += num_bytes

    def _remove(self, which: str, value: object) -> int:
        """Delete the rows one of REMOVALS selects, counting them out; how many."""
        count_sql, delete_sql = REMOVALS[which]
        count, num_bytes = self._db.execute(count_sql, (value,)).fetchone()
        if count:
            self._db.execute(delete_sql, (value,))
            self._count(-count, -int(num_bytes))
        return count

    def _expire(self, now: float) -> int:
        return self._remove("stored_before", now - self.limits.ttl_s)

    def _fits(self, cost: int) -> bool:
        assert self._totals is not None
        count, num_bytes = self._totals
        return count + (1 if cost else 0) <= self.limits.max_entries and num_bytes + cost <= self.limits.max_bytes

    def _make_room(self, cost: int, owner: str | None, keep_seq: int | None = None) -> None:
        """Delete entries (never ``keep_seq``) until one more entry of ``cost`` bytes fits (cost 0: until the
        bounds hold as they are): ``owner``'s oldest until it is within its quota, then, while the store is over
        its bounds, the oldest of the owner holding the most (module docstring)."""
        if owner is not None:
            count, num_bytes = self._db.execute("SELECT COUNT(*), TOTAL(cost) FROM stored_responses WHERE owner = ?",
                                                (owner,)).fetchone()
            owned = [count, int(num_bytes)]

            def owner_fits() -> bool:
                return (owned[0] + (1 if cost else 0) <= self.limits.per_owner_entries
                        and owned[1] + cost <= self.limits.per_owner_bytes)

            if not owner_fits():
                self._delete_oldest_of(owner, keep_seq, owner_fits, owned)
        while not self._fits(cost):
            assert self._totals is not None
            by_bytes = self._totals[1] + cost > self.limits.max_bytes
            largest = self._db.execute(  # (ties: the writer's own, then the owner with the oldest entry)
                "SELECT owner FROM stored_responses WHERE seq IS NOT ? GROUP BY owner ORDER BY "
                + ("TOTAL(cost)" if by_bytes else "COUNT(*)") + " DESC, owner = ? DESC, MIN(seq) LIMIT 1",
                (keep_seq, owner)).fetchone()
            if largest is None:
                return
            self._delete_oldest_of(largest[0], keep_seq, lambda: True, None)

    def _delete_oldest_of(self, owner: str, keep_seq: int | None, done: Callable[[], bool],
                          owned: list[int] | None) -> None:
        """Delete ``owner``'s entries oldest first (never ``keep_seq``) until ``done()`` (checked after each)."""
        doomed: list[tuple[int, int]] = []
        oldest_first = self._db.execute("SELECT seq, cost FROM stored_responses WHERE owner = ? ORDER BY seq",
                                        (owner,))
        try:
            for seq, row_cost in oldest_first:
                if seq == keep_seq:
                    continue
                doomed.append((seq, row_cost))
                self._count(-1, -row_cost)
                if owned is not None:
                    owned[0] -= 1
                    owned[1] -= row_cost
                if done():
                    break
        finally:
            oldest_first.close()  # finished reading before the table changes
        self._db.executemany("DELETE FROM stored_responses WHERE seq = ?", [(seq,) for seq, _ in doomed])


def _check_foreign(path: Path) -> None:
    """Raise ``sqlite3.DatabaseError`` when the existing file at ``path`` is not an SQLite database holding this
    store's table (with its columns) and nothing else; read-only, so the file is left as it was."""
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                               "AND name NOT LIKE 'sqlite_%'")}
        if tables - TABLES:
            raise sqlite3.DatabaseError(f"it holds other tables ({', '.join(sorted(tables)[:5])}): not this store's file")
        if tables:
            found = tuple(row[1] for row in db.execute("PRAGMA table_info(stored_responses)"))
            if found != COLUMNS:
                raise sqlite3.DatabaseError(f"its stored_responses table has columns {found}, expected {COLUMNS}")
    finally:
        db.close()


def _encodable(*texts: str) -> bool:
    """Whether every text is valid Unicode (a lone surrogate is not, and cannot be UTF-8 or an SQLite
    parameter): ``put`` stores no such text (JSON written with ``ensure_ascii``, json.dumps's default, never
    holds one), and an id holding one was never stored, so it is unknown."""
    try:
        for text in texts:
            text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def open_response_store(settings: Settings, clock: Clock = time.time, sweep: bool = True) -> ResponseStore:
    """The store the settings ask for, with its periodic sweep running (``sweep``); call at start, so a
    RESPONSES_STORE_PATH that cannot be opened stops the server with a ConfigError naming it."""
    limits = StoreLimits.from_settings(settings)
    every_s = min(SWEEP_EVERY_S, limits.ttl_s) if sweep else None
    if settings.responses_store_path:
        store: ResponseStore = SqliteResponseStore(settings.responses_store_path, limits, clock, every_s)
        count, num_bytes = store.stats()
        logger.info("response store: %s (%d entries, %d bytes kept from before)",
                    Path(settings.responses_store_path).resolve(), count, num_bytes)
        return store
    return MemoryResponseStore(limits, clock, every_s)
