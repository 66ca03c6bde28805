"""The Responses API's state in one serving process: the store of finished responses and those in flight.

It belongs to this API, not to the service: each edge opens it at start (``open_responses(settings)``,
through ``llm_api.protocols.table.open_api_states``: an unusable RESPONSES_STORE_PATH stops the start with
a ConfigError naming it), hands it to the routes in ``RouteContext.apis`` and closes it at shutdown.

``Responses`` holds ``store`` (``llm_api.protocols.responses.store``: finished responses, bounded) and
``in_flight`` (response id -> ``InFlightResponse``: its owner, the service's request id that ``cancel`` ends,
its encoder, whose Response object so far ``retrieve`` returns, and an event set when it ended), and
``background`` (the tasks running background responses: held here so none is collected while it runs; each
ends with its generation, which the engine's shutdown ends). Only the event loop touches these.

A background response created with ``stream`` keeps its events in an ``EventLog`` (each event's SSE text with
its ``sequence_number``), which its creator's stream and every later ``GET ...?stream=true&starting_after=N``
follow: the events after N, then the live ones as they come, to the end. Once it ended, its log is kept among
the ``recent`` logs (at most ``MAX_KEPT_LOGS`` of them and ``MAX_KEPT_LOG_BYTES`` in all, the oldest let go
first), so a client that lost its stream at the end can still read the rest. ``max_background_per_owner``:
the background responses one owner may have in flight (RESPONSES_BACKGROUND_PER_OWNER; past it, 429).

A background response is stored (``queued``) and claimed in the store for this process (``INCARNATION``: host,
pid and the process's start time, so a reused pid is another process) when it is created; it is released when
it ends. A process that opens the store (``open_responses``) marks the responses of claims whose process is
gone ``failed`` (``fail_orphans``): after a crash or a kill, an SQLite store (RESPONSES_STORE_PATH) answers
them as failed instead of queued for ever. They are not resumed (their generation died with the process).
A claim of another host is never judged (nothing here can see its processes).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import os
import socket
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator

from llm_api.model.settings import Settings
from llm_api.protocols.responses.store import open_response_store
from llm_api.protocols.responses.store.interface import ResponseStore


logger = logging.getLogger(__name__)
ORPHAN_ERROR = {"code": "server_error", "message": "the server stopped before this background response finished; "
                "it is not resumed: create it again"}


def _start_ticks(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, /proc), "" when it cannot be read (no such process)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


INCARNATION = f"{socket.gethostname()}/{os.getpid()}/{_start_ticks(os.getpid())}"


def incarnation_alive(incarnation: str) -> bool:
    """Whether the process a claim names still runs (a claim of another host: assumed so)."""
    host, _, rest = incarnation.partition("/")
    pid, _, ticks = rest.partition("/")
    if host != socket.gethostname() or not pid.isdigit():
        return True
    return _start_ticks(int(pid)) == ticks != ""


def fail_orphans(store: ResponseStore, alive=incarnation_alive) -> list[str]:
    """Mark the background responses of gone processes failed (module docstring); their ids."""
    failed = []
    for response_id, owner in store.orphaned_background(alive):
        stored = store.get(response_id, owner)
        if stored is None:
            continue
        response = json.loads(stored.response_json)
        if response.get("status") in ("queued", "in_progress"):
            response.update(status="failed", error=ORPHAN_ERROR)
            store.update(response_id, owner, json.dumps(response))
            failed.append(response_id)
    if failed:
        logger.info("responses: %d background responses of a stopped process marked failed", len(failed))
    return failed


MAX_KEPT_LOGS = 64  # ended background streams kept for a late reader
MAX_KEPT_LOG_BYTES = 32 * 1024 * 1024


class EventLog:
    """The events of a streamed background response, in order (module docstring)."""

    def __init__(self) -> None:
        self.sequence_numbers: list[int] = []
        self.texts: list[str] = []
        self.num_bytes = 0
        self.ended = False
        self._changed = asyncio.Event()

    def append(self, payload: str) -> None:
        """One or more SSE events as the encoder wrote them."""
        for text in payload.split("\n\n"):
            if not text.strip():
                continue
            data = json.loads(text.split("data: ", 1)[1])
            self.sequence_numbers.append(int(data["sequence_number"]))
            self.texts.append(text + "\n\n")
            self.num_bytes += len(text) + 2
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def last_sequence_number(self) -> int:
        return self.sequence_numbers[-1] if self.sequence_numbers else -1

    async def follow(self, starting_after: int) -> AsyncGenerator[str, None]:
        """The events after sequence number ``starting_after``, then the new ones as they come, to the end."""
        i = bisect.bisect_right(self.sequence_numbers, starting_after)
        while True:
            while i < len(self.texts):
                yield self.texts[i]
                i += 1
            if self.ended:
                return
            await self._changed.wait()


@dataclass
class InFlightResponse:
    owner: str
    request_id: str
    encoder: Any  # the ResponsesCall (llm_api.protocols.responses.encoder): response_json() is the answer so far
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    background: bool = False
    log: EventLog | None = None  # a background response created with stream: its events


@dataclass
class Responses:
    store: ResponseStore
    in_flight: dict[str, InFlightResponse] = field(default_factory=dict)
    background: set[asyncio.Task] = field(default_factory=set)
    max_background_per_owner: int = 8
    recent: OrderedDict[str, tuple[str, EventLog]] = field(default_factory=OrderedDict)  # id -> (owner, log)

    def background_of(self, owner: str) -> int:
        """How many background responses ``owner`` has in flight."""
        return sum(1 for entry in self.in_flight.values() if entry.background and entry.owner == owner)

    def keep_log(self, response_id: str, owner: str, log: EventLog) -> None:
        """An ended stream's log, kept for a late reader (bounded: the oldest go first)."""
        self.recent[response_id] = (owner, log)
        while len(self.recent) > MAX_KEPT_LOGS or sum(kept.num_bytes for _, kept in self.recent.values()) > \
                MAX_KEPT_LOG_BYTES:
            self.recent.popitem(last=False)

    def log_of(self, response_id: str, owner: str) -> EventLog | None:
        """The event log of ``owner``'s streamed background response, in flight or kept (None: none)."""
        live = self.in_flight.get(response_id)
        if live is not None and live.owner == owner and live.log is not None:
            return live.log
        kept = self.recent.get(response_id)
        return kept[1] if kept is not None and kept[0] == owner else None

    def run_in_background(self, work: Any) -> None:
        """Run the coroutine ``work`` on the event loop, held until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def close(self) -> None:
        self.store.close()


def open_responses(settings: Settings) -> Responses:
    store = open_response_store(settings)
    fail_orphans(store)
    return Responses(store, max_background_per_owner=settings.responses_background_per_owner)
