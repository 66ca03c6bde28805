"""The SQLite store (RESPONSES_STORE_PATH): stored responses in one file, so they survive a restart and the
TorchServe workers of one model (and the replicas of ``llm_api serve --ray``) share them.

``SqliteResponseStore`` keeps the contract of ``.interface`` in two tables: ``stored_responses`` (one row
per entry, ``seq`` in the order stored) and ``background_claims`` (the claims a crash leaves for the next
start, whichever process on the file that is). The file is made (or narrowed) to mode 0600 before SQLite
opens it, since stored conversations are the users' text; an existing file that is not this store's (not
SQLite, or holding other tables or other columns) is refused untouched, read-only. Each change is one write
transaction (``BEGIN IMMEDIATE``: SQLite's write lock), with the totals the bounds need read again when
another process wrote the file; every value reaches SQL as a parameter, never formatted into a statement.
A full disk or a file locked past the timeout loses the entry being stored (logged) and serving goes on.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from llm_api.model.settings import ConfigError
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

logger = logging.getLogger(__name__)

# The SQLite file holds about its counted bytes (0.5x to 1.2x measured, entries of 100 B to 100 KB: pages
# left part empty by rows of about 3 KB are the most), plus its write-ahead log, cut back to this after
# each checkpoint (SQLite checkpoints at 1,000 pages, 4 MiB).
WAL_LIMIT_BYTES = 4 << 20


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
        self._sweeper = Sweeper(self.sweep, sweep_every_s) if sweep_every_s else None

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
        check_id(response_id)
        if not encodable(response_id, owner, response_json, conversation_json):
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
        if not encodable(response_id, owner):
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
        if not same_owner(row[0], owner):
            return None
        return StoredResponse(response_id, row[0], row[1], row[2], row[3])

    def update(self, response_id: str, owner: str, response_json: str, conversation_json: str | None = None) -> bool:
        if not encodable(response_id, owner, response_json, conversation_json or ""):
            return False
        with self._lock, self._changing() as db:
            self._expire(self._clock())
            row = db.execute("SELECT seq, owner, cost, conversation_json FROM stored_responses WHERE response_id = ?",
                             (response_id,)).fetchone()
            if row is None or not same_owner(row[1], owner):
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
        if not encodable(response_id, owner):
            return False
        with self._lock, self._changing() as db:
            self._expire(self._clock())
            row = db.execute("SELECT seq, owner FROM stored_responses WHERE response_id = ?",
                             (response_id,)).fetchone()
            if row is None or not same_owner(row[1], owner):
                return False
            self._remove("seq", row[0])
            return True

    def sweep(self) -> int:
        with self._lock, self._changing():
            return self._expire(self._clock())

    def claim_background(self, response_id: str, owner: str, incarnation: str) -> None:
        if not encodable(response_id, owner, incarnation):
            return
        try:
            with self._lock, self._changing() as db:
                db.execute("INSERT OR REPLACE INTO background_claims (response_id, owner, incarnation) "
                           "VALUES (?, ?, ?)", (response_id, owner, incarnation))
        except sqlite3.OperationalError:  # (as for put: the response runs on; a crash would leave it queued)
            logger.exception("response store: could not claim a background response in %s", self.path)

    def release_background(self, response_id: str) -> None:
        if not encodable(response_id):
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
