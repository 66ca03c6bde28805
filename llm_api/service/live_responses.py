"""The Responses API's state in one serving process: the store of finished responses and those in flight.

``Responses(store)`` is what ``ModelService.responses`` holds: ``store`` (``llm_api.service.response_store``:
finished responses, bounded) and ``in_flight`` (response id -> ``InFlightResponse``: its owner, the
service's request id that ``cancel`` ends, its encoder, whose Response object so far ``retrieve``
returns, and an event set when it ended), and ``background`` (the tasks running background responses:
held here so none is collected while it runs; each ends with its generation, which the engine's shutdown
ends). Only the event loop touches these.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from llm_api.service.response_store import ResponseStore


@dataclass
class InFlightResponse:
    owner: str
    request_id: str
    encoder: Any  # the ResponsesCall (llm_api.protocols.responses.encoder): response_json() is the answer so far
    ended: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Responses:
    store: ResponseStore
    in_flight: dict[str, InFlightResponse] = field(default_factory=dict)
    background: set[asyncio.Task] = field(default_factory=set)

    def run_in_background(self, work: Any) -> None:
        """Run the coroutine ``work`` on the event loop, held until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
