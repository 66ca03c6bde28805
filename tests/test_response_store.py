"""The response store (llm_api.protocols.responses.store): bounds, TTL, owners, SQLite persistence.

Both stores run the same tests through ``make_store`` (memory, and SQLite in a temporary file); the clock is
injected, so expiry needs no waiting. The flood test puts 100,000 entries of random sizes and checks the
bounds after every put and the memory held (tracemalloc) against the byte bound; the overhead test checks
that ``ENTRY_OVERHEAD_BYTES`` covers what an entry costs besides its text, and is not far above it.
"""

from __future__ import annotations

import gc
import json
import random
import sqlite3
import stat
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from llm_api.model.settings import ConfigError, Settings
from llm_api.service.owners import owner_of
from llm_api.protocols.responses.store import open_response_store
from llm_api.protocols.responses.store.interface import ENTRY_OVERHEAD_BYTES, StoreLimits, entry_cost
from llm_api.protocols.responses.store.memory import MemoryResponseStore
from llm_api.protocols.responses.store.sqlite import WAL_LIMIT_BYTES, SqliteResponseStore

ALICE = owner_of("Bearer alice-key-123")
BOB = owner_of("Bearer bob-key-4567")
BIG = StoreLimits(max_entries=1000, max_bytes=1 << 24, ttl_s=3600.0)


class Clock:
    def __init__(self, now: float = 1_700_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request, tmp_path):
    made = []

    def make(limits: StoreLimits = BIG, clock=time.time, path: Path | None = None, **kw):
        if request.param == "memory":
            store = MemoryResponseStore(limits, clock, **kw)
        else:
            store = SqliteResponseStore(path or tmp_path / "responses.db", limits, clock, **kw)
        made.append(store)
        return store

    make.kind = request.param  # type: ignore[attr-defined]
    yield make
    for store in made:
        try:
            store.close()
        except sqlite3.ProgrammingError:  # closed by the test already
            pass


def texts(response_id: str, size: int = 10) -> tuple[str, str]:
    response = json.dumps({"id": response_id, "object": "response", "output_text": "x" * size})
    conversation = json.dumps([{"role": "user", "content": "y" * size}])
    return response, conversation


def cost_of(response_id: str, owner: str, size: int = 10) -> int:
    response, conversation = texts(response_id, size)
    return entry_cost(response_id, owner, response.encode(), conversation.encode())


# ---------------------------------------------------------------------------------------------------
# the interface, on both stores


def test_put_get_delete_and_owners(make_store):
    store = make_store()
    response, conversation = texts("resp_1")
    assert store.put("resp_1", ALICE, response, conversation)
    got = store.get("resp_1", ALICE)
    assert got is not None and (got.response_json, got.conversation_json, got.owner) == (response, conversation, ALICE)
    # Another owner sees nothing, and can neither change nor delete it.
    assert store.get("resp_1", BOB) is None
    assert not store.update("resp_1", BOB, "{}") and not store.delete("resp_1", BOB)
    assert store.get("resp_1", ALICE).response_json == response  # type: ignore[union-attr]
    assert store.get("resp_unknown", ALICE) is None and not store.delete("resp_unknown", ALICE)
    assert store.stats() == (1, cost_of("resp_1", ALICE))
    assert store.delete("resp_1", ALICE)
    assert store.get("resp_1", ALICE) is None and not store.delete("resp_1", ALICE) and store.stats() == (0, 0)


def test_update_keeps_the_entry_and_its_place(make_store):
    clock = Clock()
    store = make_store(StoreLimits(max_entries=2, max_bytes=1 << 20, ttl_s=100.0), clock)
    store.put("resp_a", ALICE, *texts("resp_a"))
    clock.now += 10
    store.put("resp_b", ALICE, *texts("resp_b"))
    assert store.update("resp_a", ALICE, '{"status": "cancelled"}')
    got = store.get("resp_a", ALICE)
    assert got is not None and got.response_json == '{"status": "cancelled"}' and got.created_at == clock.now - 10
    assert got.conversation_json == texts("resp_a")[1]  # untouched when not given
    assert store.update("resp_a", ALICE, "{}", "[1]") and store.get("resp_a", ALICE).conversation_json == "[1]"  # type: ignore[union-attr]
    assert store.stats()[1] == entry_cost("resp_a", ALICE, b"{}", b"[1]") + cost_of("resp_b", ALICE)
    store.put("resp_c", ALICE, *texts("resp_c"))  # resp_a is still the oldest: evicted first
    assert store.get("resp_a", ALICE) is None and store.get("resp_b", ALICE) is not None
    # An update that no longer fits removes the entry (it could not be stored as it is).
    assert not store.update("resp_b", ALICE, "z" * (1 << 20))
    assert store.get("resp_b", ALICE) is None and store.stats() == (1, cost_of("resp_c", ALICE))


def test_update_that_grows_evicts_others_not_itself(make_store):
    one = cost_of("resp_0", ALICE)
    store = make_store(StoreLimits(max_entries=10, max_bytes=3 * one, ttl_s=100.0))
    for i in range(3):
        assert store.put(f"resp_{i}", ALICE, *texts(f"resp_{i}"))
    assert store.update("resp_0", ALICE, texts("resp_0", 10 + one)[0])  # about one entry bigger
    assert store.get("resp_0", ALICE) is not None and store.get("resp_1", ALICE) is None
    assert store.stats()[1] <= 3 * one


def test_bounds_evict_the_oldest_first(make_store):
    one = cost_of("resp_00", ALICE)
    store = make_store(StoreLimits(max_entries=3, max_bytes=1 << 20, ttl_s=100.0))
    for i in range(5):
        assert store.put(f"resp_{i:02}", ALICE, *texts(f"resp_{i:02}"))
    assert [store.get(f"resp_{i:02}", ALICE) is not None for i in range(5)] == [False, False, True, True, True]
    assert store.stats() == (3, 3 * one)


def test_the_byte_bound_evicts_the_oldest_first(make_store, tmp_path):
    one = cost_of("resp_00", ALICE)
    store = make_store(StoreLimits(max_entries=100, max_bytes=2 * one + 5, ttl_s=100.0), path=tmp_path / "b.db")
    for i in range(4):
        assert store.put(f"resp_{i:02}", ALICE, *texts(f"resp_{i:02}"))
    assert [store.get(f"resp_{i:02}", ALICE) is not None for i in range(4)] == [False, False, True, True]
    assert store.stats() == (2, 2 * one)


def test_an_entry_above_the_byte_bound_is_not_stored_and_evicts_nothing(make_store):
    store = make_store(StoreLimits(max_entries=10, max_bytes=4096, ttl_s=100.0))
    assert store.put("resp_small", ALICE, *texts("resp_small"))
    assert not store.put("resp_huge", ALICE, *texts("resp_huge", 4096))
    assert store.get("resp_huge", ALICE) is None and store.get("resp_small", ALICE) is not None
    assert store.stats() == (1, cost_of("resp_small", ALICE))


def test_zero_entries_stores_nothing(make_store):
    store = make_store(StoreLimits(max_entries=0, max_bytes=1 << 20, ttl_s=100.0))
    assert not store.put("resp_1", ALICE, *texts("resp_1")) and store.get("resp_1", ALICE) is None
    assert store.stats() == (0, 0)


def test_put_again_replaces_and_moves_to_the_back(make_store):
    clock = Clock()
    store = make_store(StoreLimits(max_entries=2, max_bytes=1 << 20, ttl_s=100.0), clock)
    store.put("resp_a", ALICE, *texts("resp_a"))
    store.put("resp_b", ALICE, *texts("resp_b"))
    clock.now += 1
    store.put("resp_a", BOB, '{"v": 2}', "[]")
    store.put("resp_c", ALICE, *texts("resp_c"))  # evicts resp_b, now the oldest
    assert store.get("resp_b", ALICE) is None and store.get("resp_a", ALICE) is None
    assert store.get("resp_a", BOB).response_json == '{"v": 2}'  # type: ignore[union-attr]


def test_entries_expire_after_the_ttl(make_store):
    clock = Clock()
    store = make_store(StoreLimits(max_entries=100, max_bytes=1 << 20, ttl_s=60.0), clock)
    store.put("resp_old", ALICE, *texts("resp_old"))
    clock.now += 30
    store.put("resp_new", ALICE, *texts("resp_new"))
    clock.now += 29.9
    assert store.get("resp_old", ALICE) is not None
    clock.now += 0.1  # resp_old is 60 s old: gone on access, for every method
    assert store.get("resp_old", ALICE) is None and not store.update("resp_old", ALICE, "{}")
    assert not store.delete("resp_old", ALICE) and store.stats() == (1, cost_of("resp_new", ALICE))
    clock.now += 30
    assert store.sweep() == 1 and store.stats() == (0, 0)


def test_expired_entries_go_without_being_asked_for(make_store):
    """The periodic sweep: a quiet server drops expired text too."""
    clock = Clock()
    store = make_store(StoreLimits(max_entries=100, max_bytes=1 << 20, ttl_s=60.0), clock, sweep_every_s=0.02)
    for i in range(5):
        store.put(f"resp_{i}", ALICE, *texts(f"resp_{i}"))
    time.sleep(0.1)
    assert store.stats()[0] == 5
    clock.now += 61
    deadline = time.monotonic() + 10
    while store.stats() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.stats() == (0, 0)


HOSTILE_IDS = [
    "resp_' OR '1'='1",
    "x'); DROP TABLE stored_responses; --",
    'resp_"; DELETE FROM stored_responses; --',
    "resp_%s%s%s{0}{}",
    "resp_ü\u202e\u0000nul",
    "😀" * 64,
    "resp_\\x00\r\n",
]


@pytest.mark.parametrize("response_id", HOSTILE_IDS)
def test_hostile_ids_are_only_ids(make_store, response_id):
    store = make_store()
    store.put("resp_plain", ALICE, *texts("resp_plain"))
    assert store.get(response_id, ALICE) is None and not store.delete(response_id, ALICE)
    assert store.put(response_id, ALICE, *texts(response_id))
    assert store.get(response_id, ALICE).response_json == texts(response_id)[0]  # type: ignore[union-attr]
    assert store.get(response_id, BOB) is None
    assert store.get("resp_plain", ALICE) is not None and store.stats()[0] == 2  # nothing else touched
    assert store.delete(response_id, ALICE) and store.get(response_id, ALICE) is None


def test_ids_that_were_never_storable(make_store):
    store = make_store()
    store.put("resp_plain", ALICE, *texts("resp_plain"))
    for response_id in ("r" * 10_000_000, "resp_\ud800", "", "resp_plain "):  # huge, a lone surrogate, empty
        assert store.get(response_id, ALICE) is None and not store.delete(response_id, ALICE)
        assert not store.update(response_id, ALICE, "{}")
    with pytest.raises(ValueError):
        store.put("r" * 257, ALICE, "{}", "[]")
    assert not store.put("resp_x", ALICE, '"\ud800"', "[]")  # not valid Unicode: not stored
    assert store.get("resp_plain", "\ud800") is None
    assert store.stats() == (1, cost_of("resp_plain", ALICE))


def test_threads_put_get_and_delete_at_once(make_store):
    store = make_store(StoreLimits(max_entries=100_000, max_bytes=1 << 26, ttl_s=3600.0))
    owners = [owner_of(f"Bearer key-{n}-xxxxxxxx") for n in range(8)]
    failures: list[str] = []

    def work(n: int) -> None:
        mine, theirs = owners[n], owners[(n + 1) % len(owners)]
        for i in range(150):
            response_id = f"resp_{n}_{i}"
            response, conversation = texts(response_id, i)
            store.put(response_id, mine, response, conversation)
            got = store.get(response_id, mine)
            if got is None or got.response_json != response or got.conversation_json != conversation:
                failures.append(f"{response_id}: {got}")
            if store.get(response_id, theirs) is not None:
                failures.append(f"{response_id} readable by another owner")
            if i % 3 == 0 and not store.delete(response_id, mine):
                failures.append(f"{response_id} not deleted")

    threads = [threading.Thread(target=work, args=(n,)) for n in range(len(owners))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:5]
    kept = [(n, i) for n in range(len(owners)) for i in range(150) if i % 3]
    expected = sum(cost_of(f"resp_{n}_{i}", owners[n], i) for n, i in kept)
    assert store.stats() == (len(kept), expected)


# ---------------------------------------------------------------------------------------------------
# the flood, and what an entry costs (memory store)


ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.{}\"" * 512


def flood(store, num_puts: int, max_size: int, seed: int, check_every: int = 1) -> int:
    """``num_puts`` puts of random sizes (0 to ``max_size`` characters of text, fresh strings as a route hands
    over), the bounds checked after every ``check_every``-th; how many puts were refused."""
    rng = random.Random(seed)
    num_refused = 0
    for i in range(num_puts):
        size = rng.randrange(0, max_size)
        start = rng.randrange(0, len(ALPHABET) - size)
        owner = owner_of(f"Bearer key-{i % 7}-xxxxxxxx")
        num_refused += not store.put(f"resp_{i:032x}", owner, ALPHABET[start:start + size // 3],
                                     ALPHABET[start:start + size - size // 3])
        if i % check_every == 0:
            count, num_bytes = store.stats()
            assert count <= store.limits.max_entries and num_bytes <= store.limits.max_bytes, i
    return num_refused


def test_bounds_hold_under_a_flood():
    """100,000 puts: after every one the entries and bytes are within the bounds, the byte bound is what
    bites with big entries and the count bound with small ones."""
    store = MemoryResponseStore(StoreLimits(max_entries=5_000, max_bytes=2 << 20, ttl_s=3600.0))
    assert flood(store, 80_000, 4096, seed=23) == 0
    assert store.stats()[1] > 0.95 * store.limits.max_bytes
    store.limits = StoreLimits(max_entries=500, max_bytes=2 << 20, ttl_s=3600.0)
    assert flood(store, 20_000, 256, seed=24) == 0
    assert store.stats()[0] == 500


def test_memory_held_stays_within_the_byte_bound():
    """20,000 puts of 0 to 16 KiB into an 8 MiB store (about 1,000 entries held, 19,000 evicted): the memory
    the store holds (tracemalloc) is what it counts, at most, and within the byte bound."""
    store = MemoryResponseStore(StoreLimits(max_entries=5_000, max_bytes=8 << 20, ttl_s=3600.0))
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        assert flood(store, 20_000, 16 << 10, seed=25, check_every=10) == 0
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    count, num_bytes = store.stats()
    print(f"\nflood: {count} entries, {num_bytes} bytes counted, {held} bytes held (tracemalloc), "
          f"{held / store.limits.max_bytes:.3f} of the byte bound")
    assert num_bytes > 0.95 * store.limits.max_bytes  # the byte bound is what bit
    assert held <= num_bytes + (64 << 10) and held <= store.limits.max_bytes  # 64 KiB: the table's fixed part


def test_sqlite_bounds_hold_under_a_flood(tmp_path):
    """3,000 puts (6 MB of text) into a 1 MiB store: the bounds hold, and so does the file on disk."""
    store = SqliteResponseStore(tmp_path / "flood.db", StoreLimits(max_entries=2_000, max_bytes=1 << 20, ttl_s=3600.0))
    assert flood(store, 3_000, 4096, seed=26, check_every=7) == 0
    count, num_bytes = store.stats()
    assert num_bytes > 0.95 * store.limits.max_bytes
    assert store._totals == [count, num_bytes]  # the totals kept with each change are the table's
    wal = tmp_path / "flood.db-wal"
    assert (tmp_path / "flood.db").stat().st_size <= 1.25 * store.limits.max_bytes
    assert not wal.exists() or wal.stat().st_size <= WAL_LIMIT_BYTES + (1 << 20)
    store.close()


def test_entry_overhead_covers_what_an_entry_costs_besides_its_text():
    store = MemoryResponseStore(StoreLimits(max_entries=100_000, max_bytes=1 << 40, ttl_s=3600.0))
    num = 20_000
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(num):
            store.put(f"resp_{i:032x}", owner_of(f"Bearer key-{i % 3}-xxxxxxxx"), "r" * 100, "c" * 200)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    text = len(f"resp_{0:032x}") + 64 + 300
    overhead = held / num - text
    print(f"\nentry overhead: {overhead:.0f} bytes measured, {ENTRY_OVERHEAD_BYTES} counted")
    assert overhead <= ENTRY_OVERHEAD_BYTES and overhead >= 0.6 * ENTRY_OVERHEAD_BYTES
    assert store.stats()[1] == num * (text + ENTRY_OVERHEAD_BYTES)


# ---------------------------------------------------------------------------------------------------
# SQLite


def test_sqlite_entries_survive_a_reopen(tmp_path):
    clock = Clock()
    path = tmp_path / "store.db"
    store = SqliteResponseStore(path, BIG, clock)
    for i in range(3):
        store.put(f"resp_{i}", ALICE if i else BOB, *texts(f"resp_{i}"))
    store.delete("resp_2", ALICE)
    store.close()
    store = SqliteResponseStore(path, BIG, clock)
    assert store.get("resp_0", BOB).response_json == texts("resp_0")[0]  # type: ignore[union-attr]
    assert store.get("resp_0", ALICE) is None and store.get("resp_2", ALICE) is None
    assert store.get("resp_1", ALICE).created_at == clock.now  # type: ignore[union-attr]
    store.close()
    # Smaller bounds at the next start apply at once (oldest first), and so does the TTL.
    store = SqliteResponseStore(path, StoreLimits(max_entries=1, max_bytes=1 << 20, ttl_s=3600.0), clock)
    assert store.stats() == (1, cost_of("resp_1", ALICE)) and store.get("resp_1", ALICE) is not None
    store.close()
    clock.now += 3600
    store = SqliteResponseStore(path, BIG, clock)
    assert store.stats() == (0, 0)
    store.close()


def test_sqlite_file_is_private_and_in_wal_mode(tmp_path):
    path = tmp_path / "store.db"
    path.write_bytes(b"")
    path.chmod(0o644)  # an existing empty file is narrowed too
    store = SqliteResponseStore(path, BIG)
    store.put("resp_1", ALICE, *texts("resp_1"))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["store.db", "store.db-shm", "store.db-wal"]
    for name in files:
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    with sqlite3.connect(path) as other:
        assert other.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert other.execute("SELECT response_id, owner FROM stored_responses").fetchall() == [("resp_1", ALICE)]
        # The key behind the owner is nowhere in the file.
        assert "alice-key-123" not in "".join(other.iterdump())
    store.close()


@pytest.mark.parametrize("size", [40, 20_000])  # in the table's page; on overflow pages
def test_sqlite_deleted_text_leaves_the_file(tmp_path, size):
    path = tmp_path / "deleted.db"
    store = SqliteResponseStore(path, BIG)
    secret = ("the-user-said-" * size)[:size]
    store.put("resp_keep", ALICE, *texts("resp_keep"))
    store.put("resp_gone", ALICE, json.dumps({"text": secret}), json.dumps([secret]))
    assert store.delete("resp_gone", ALICE)
    store.close()  # the last connection's close checkpoints the WAL into the file
    held = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    assert secret[:40].encode() not in held and b"resp_keep" in held


def test_two_connections_on_one_file_share_the_bounds(tmp_path):
    """TorchServe's workers of one model open the same file: the totals come from the table, so each
    process's puts count against the others' entries."""
    path = tmp_path / "shared.db"
    limits = StoreLimits(max_entries=3, max_bytes=1 << 20, ttl_s=3600.0)
    first, second = SqliteResponseStore(path, limits), SqliteResponseStore(path, limits)
    for i in range(6):
        (first if i % 2 else second).put(f"resp_{i}", ALICE, *texts(f"resp_{i}"))
    assert first.stats()[0] == 3 and [second.get(f"resp_{i}", ALICE) is not None for i in range(6)] == [
        False, False, False, True, True, True]
    # What one deletes, the other no longer counts: two more puts evict nothing.
    assert second.delete("resp_3", ALICE) and second.delete("resp_4", ALICE)
    first.put("resp_6", ALICE, *texts("resp_6"))
    first.put("resp_7", ALICE, *texts("resp_7"))
    assert [first.get(f"resp_{i}", ALICE) is not None for i in (5, 6, 7)] == [True, True, True]
    first.close()
    second.close()


def test_sqlite_put_that_cannot_write_loses_only_that_entry(tmp_path):
    path = tmp_path / "busy.db"
    store = SqliteResponseStore(path, BIG, busy_timeout_s=0.05)
    assert store.put("resp_1", ALICE, *texts("resp_1"))
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock past the timeout
    try:
        assert not store.put("resp_2", ALICE, *texts("resp_2"))
        assert store.get("resp_1", ALICE) is not None  # reading goes on (WAL)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert store.put("resp_2", ALICE, *texts("resp_2")) and store.stats()[0] == 2
    store.close()


@pytest.mark.parametrize("case", ["directory", "missing_parent", "not_sqlite", "other_table", "another_apps_db"])
def test_a_store_path_that_cannot_be_opened_names_the_variable(tmp_path, case):
    path = tmp_path / "store.db"
    if case == "directory":
        path.mkdir()
    elif case == "missing_parent":
        path = tmp_path / "no" / "such" / "store.db"
    elif case == "not_sqlite":
        path.write_bytes(b"this is not a database, " * 200)
    elif case == "other_table":
        with sqlite3.connect(path) as other:
            other.execute("CREATE TABLE stored_responses (id TEXT)")
    else:
        with sqlite3.connect(path) as other:
            other.execute("CREATE TABLE accounts (name TEXT)")
    before = (path.stat().st_mode, path.read_bytes()) if path.is_file() else None
    if before is not None:
        path.chmod(0o644)
        before = (path.stat().st_mode, path.read_bytes())
    with pytest.raises(ConfigError) as err:
        SqliteResponseStore(path, BIG)
    assert "RESPONSES_STORE_PATH" in str(err.value) and str(path) in str(err.value)
    with pytest.raises(ConfigError):
        open_response_store(Settings.from_env({"RESPONSES_STORE_PATH": str(path)}), sweep=False)
    if before is not None:  # refused untouched: neither its mode nor its bytes changed
        assert (path.stat().st_mode, path.read_bytes()) == before


# ---------------------------------------------------------------------------------------------------
# settings


def test_settings_and_the_store_they_open(tmp_path):
    defaults = Settings.from_env({})
    assert (defaults.responses_store_max_entries, defaults.responses_store_max_bytes, defaults.responses_store_ttl_s,
            defaults.responses_store_path) == (10_000, 64 << 20, 86_400.0, "")
    store = open_response_store(defaults)
    assert isinstance(store, MemoryResponseStore) and store.limits == StoreLimits(10_000, 64 << 20, 86_400.0,
                                                                                  2_500, 16 << 20)
    store.close()
    settings = Settings.from_env({"RESPONSES_STORE_PATH": str(tmp_path / "s.db"), "RESPONSES_STORE_MAX_ENTRIES": "5",
                                  "RESPONSES_STORE_MAX_BYTES": "4096", "RESPONSES_STORE_TTL_S": "1.5"})
    store = open_response_store(settings)
    assert isinstance(store, SqliteResponseStore) and store.limits == StoreLimits(5, 4096, 1.5, 2_500, 16 << 20)
    assert (store.limits.per_owner_entries, store.limits.per_owner_bytes) == (5, 4096)  # (never above the whole)
    store.close()


@pytest.mark.parametrize("name, value, needle", [
    ("RESPONSES_STORE_MAX_ENTRIES", "-1", "allowed values: integers >= 0"),
    ("RESPONSES_STORE_MAX_ENTRIES", "many", "is not an integer"),
    ("RESPONSES_STORE_MAX_BYTES", "100", "allowed values: integers >= 1024"),
    ("RESPONSES_STORE_TTL_S", "0", "allowed values: numbers > 0"),
    ("RESPONSES_STORE_TTL_S", "a day", "is not a number"),
    ("RESPONSES_STORE_PATH", " store.db", "allowed values: empty (memory) or a file path"),
])
def test_bad_store_settings_name_the_variable(name, value, needle):
    with pytest.raises(ConfigError) as err:
        Settings.from_env({name: value})
    assert name in str(err.value) and needle in str(err.value)


# ---------------------------------------------------------------------------------------------------
# per-owner quotas


def test_one_owners_flood_evicts_its_own_history_first(make_store):
    """The red team's flood: one key's large responses (tools echoed into each) once pushed every other key's
    entries out. Now an owner over its quota, or a writer into a full store, loses its own oldest entries;
    another owner's entries stay readable."""
    limits = StoreLimits(max_entries=20, max_bytes=1 << 20, ttl_s=3600.0, owner_max_entries=8, owner_max_bytes=200_000)
    store = make_store(limits)
    bob_ids = [f"resp_bob_{i}" for i in range(6)]
    for response_id in bob_ids:
        assert store.put(response_id, BOB, *texts(response_id))
    flood = [f"resp_alice_{i}" for i in range(40)]
    for response_id in flood:  # each ~64 KB: the byte quota (about 3 entries) bites before the entry count
        assert store.put(response_id, ALICE, *texts(response_id, size=32_000))
    assert all(store.get(response_id, BOB) is not None for response_id in bob_ids)
    kept = [response_id for response_id in flood if store.get(response_id, ALICE) is not None]
    assert kept == flood[-len(kept):] and 1 <= len(kept) <= 3  # alice's newest only, within her quota
    # Small entries: the entry quota bites; still nobody else's.
    for i in range(30):
        assert store.put(f"resp_alice_small_{i}", ALICE, *texts(f"resp_alice_small_{i}"))
    assert all(store.get(response_id, BOB) is not None for response_id in bob_ids)
    count, _ = store.stats()
    assert count == len(bob_ids) + 8


def test_a_full_store_evicts_the_largest_holders_oldest(make_store):
    """Within their quotas, the owner holding the most gives way when the whole store is full: the writer when
    it is the flooder, the flooder when a small holder writes."""
    limits = StoreLimits(max_entries=10, max_bytes=1 << 20, ttl_s=3600.0, owner_max_entries=8)
    store = make_store(limits)
    for i in range(8):
        assert store.put(f"resp_alice_{i}", ALICE, *texts(f"resp_alice_{i}"))
    for i in range(3):  # a small holder writing into a full store: alice's oldest give way
        assert store.put(f"resp_bob_{i}", BOB, *texts(f"resp_bob_{i}"))
    assert store.get("resp_alice_0", ALICE) is None and store.get("resp_alice_2", ALICE) is not None
    for i in range(8, 20):  # alice writing on: her own oldest, never bob's
        assert store.put(f"resp_alice_{i}", ALICE, *texts(f"resp_alice_{i}"))
    assert all(store.get(f"resp_bob_{i}", BOB) is not None for i in range(3))
    assert store.stats()[0] == 10


# ---------------------------------------------------------------------------------------------------
# background responses of a process that is gone


def test_claims_of_gone_processes_are_taken_back_once(make_store):
    store = make_store()
    store.claim_background("resp_a", ALICE, "here")
    store.claim_background("resp_b", BOB, "gone")
    store.claim_background("resp_c", ALICE, "gone")
    store.release_background("resp_c")  # (ended: no longer claimed)
    assert store.orphaned_background(lambda incarnation: incarnation != "gone") == [("resp_b", BOB)]
    assert store.orphaned_background(lambda incarnation: incarnation != "gone") == []
    assert store.orphaned_background(lambda incarnation: False) == [("resp_a", ALICE)]


def test_a_crashed_processs_background_responses_are_failed_at_the_next_open(tmp_path):
    """What a restart after a crash finds (llm_api.protocols.responses.state.fail_orphans): the queued or running
    response of a gone process is failed, with the error saying so; one that finished before the crash, or
    whose process still runs, is left as it is."""
    from llm_api.protocols.responses.state import INCARNATION, ORPHAN_ERROR, fail_orphans, incarnation_alive

    path = tmp_path / "store.db"
    store = SqliteResponseStore(path, BIG)
    for response_id, status in (("resp_queued", "queued"), ("resp_running", "in_progress"), ("resp_done", "completed"),
                                ("resp_live", "queued")):
        store.put(response_id, ALICE, json.dumps({"id": response_id, "status": status}), "[]")
        store.claim_background(response_id, ALICE, INCARNATION if response_id == "resp_live" else "dead")
    store.close()  # (the crash: the claims stay in the file)
    store = SqliteResponseStore(path, BIG)
    assert sorted(fail_orphans(store, lambda incarnation: incarnation == INCARNATION)) == ["resp_queued",
                                                                                           "resp_running"]
    for response_id, status in (("resp_queued", "failed"), ("resp_running", "failed"), ("resp_done", "completed"),
                                ("resp_live", "queued")):
        response = json.loads(store.get(response_id, ALICE).response_json)  # type: ignore[union-attr]
        assert response["status"] == status and (response.get("error") == ORPHAN_ERROR) == (status == "failed")
    store.close()
    assert incarnation_alive(INCARNATION)
    host, pid, ticks = INCARNATION.split("/")
    assert not incarnation_alive(f"{host}/{pid}/{int(ticks) + 1}")  # (the pid reused by another process)
    assert not incarnation_alive(f"{host}/999999999/1")
    assert incarnation_alive(f"another-host-{host}/1/1")  # (another host's processes cannot be seen: kept)
