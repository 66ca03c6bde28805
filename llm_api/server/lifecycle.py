"""The server's state for probes and shutdown: loading -> ready -> draining -> stopped.

``Lifecycle`` is shared by the HTTP and gRPC front: ``/ready`` reads ``accepting`` (the model is loaded
and no drain began), every generation registers itself with ``track(request_id)`` while it runs, and
``drain(grace_s)`` (on SIGTERM) stops accepting at once, waits for the tracked requests to end for at
most ``grace_s`` seconds, then cancels what is left through ``cancel`` (each such stream ends with its
``cancelled`` error line, never cut) and waits briefly for those ends to be written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import contextmanager
from typing import Callable

logger = logging.getLogger(__name__)
FLUSH_AFTER_CANCEL_S = 5.0  # time for cancelled streams to write their error line after the grace


class Lifecycle:
    def __init__(self) -> None:
        self.loaded = False
        self.draining = False
        self.stop_requested = asyncio.Event()
        self._in_flight: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._hurry = asyncio.Event()  # a second stop signal: skip the rest of the grace period

    @property
    def accepting(self) -> bool:
        return self.loaded and not self.draining

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @contextmanager
    def track(self, request_id: str):
        self._in_flight.add(request_id)
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight.discard(request_id)
            if not self._in_flight:
                self._idle.set()

    def request_stop(self) -> None:
        """The signal handler: readiness turns false now; ``server`` runs the drain."""
        if self.stop_requested.is_set():
            logger.info("second stop signal: cancelling the %d requests left now", len(self._in_flight))
            self._hurry.set()
        else:
            logger.info("stop requested: draining %d in-flight requests", len(self._in_flight))
        self.draining = True
        self.stop_requested.set()

    async def drain(self, grace_s: float, cancel: Callable[[str], bool] | None) -> None:
        self.draining = True
        started = time.monotonic()
        idle, hurry = asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._hurry.wait())
        await asyncio.wait([idle, hurry], timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        idle.cancel()
        hurry.cancel()
        if not self._in_flight:
            logger.info("drained: every request ended within %.1f s", time.monotonic() - started)
            return
        left = sorted(self._in_flight)
        logger.warning("drain: %d requests still running after %.1f s (grace period %.0f s); cancelling them",
                       len(left), time.monotonic() - started, grace_s)
        if cancel is not None:
            for request_id in left:
                cancel(request_id)
        try:
            await asyncio.wait_for(self._idle.wait(), FLUSH_AFTER_CANCEL_S)
        except TimeoutError:
            logger.warning("drain: %d requests did not end after their cancel", len(self._in_flight))
