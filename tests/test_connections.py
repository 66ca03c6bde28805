"""The connection guard's rules (llm_api.server.connections) on its own, with transports that record their
close: a connection's grace is counted in loop turns, so a congested loop cannot run it out in wall time."""

from __future__ import annotations

import asyncio
import time
import types

from llm_api.server import connections
from llm_api.server.connections import ConnectionGuard, ConnectionLimits


class Transport:
    def __init__(self, address: str = "10.0.0.1"):
        self.address = address
        self.closed = False

    def get_extra_info(self, name):
        return (self.address, 40000) if name == "peername" else None

    def close(self):
        self.closed = True


def guard(max_per_client: int = 4) -> ConnectionGuard:
    return ConnectionGuard(ConnectionLimits(max_connections=8, max_per_client=max_per_client, max_untrusted=64,
                                            header_timeout_s=5.0))


def open_connection(g: ConnectionGuard, transport: Transport | None = None) -> tuple[object, Transport]:
    handler, transport = object(), transport or Transport()
    g.opened(handler, transport)
    return handler, transport


def test_a_new_connection_is_not_evicted_before_its_grace_in_loop_turns_however_long_it_waited():
    g = guard()
    _, key_holder = open_connection(g)  # its head is still on its way through a congested loop
    attackers = [open_connection(g)[1] for _ in range(3)]
    time.sleep(0.5)  # wall time past the old 0.2 s grace, no loop turn
    for _ in range(20):  # a burst from the same address, over MAX_CONNECTIONS_PER_CLIENT
        open_connection(g)
    assert not key_holder.closed
    assert not any(a.closed for a in attackers)
    assert g.num_evicted == 0


def test_past_its_grace_the_oldest_untrusted_connection_gives_way():
    g = guard()
    _, first = open_connection(g)
    rest = [open_connection(g)[1] for _ in range(3)]
    g.ticks += connections.GRACE_TICKS
    open_connection(g)
    assert first.closed and not any(t.closed for t in rest)
    assert g.num_evicted == 1


def test_a_connection_with_a_request_in_progress_is_never_evicted():
    g = guard(max_per_client=1)
    busy, transport = open_connection(g)
    g.request_started(busy)
    g.ticks += connections.GRACE_TICKS
    open_connection(g)
    assert not transport.closed


def test_the_ticker_turns_at_most_once_per_loop_iteration():
    """What the grace relies on: one turn per iteration, even when the loop was blocked past several periods."""
    async def run() -> int:
        g = guard()
        g.install(types.SimpleNamespace(connection_made=None, connection_lost=None))  # (an aiohttp web.Server's hooks)
        time.sleep(connections.TICK_S * 6)  # the loop blocked for six periods
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        turns = g.ticks
        g.close()
        return turns

    assert asyncio.run(run()) <= 2
