"""The Responses API's state in one serving process: the store of finished responses and those in flight.

It belongs to this API, not to the service: each edge opens it at start (``open_responses(settings)``,
through ``llm_api.protocols.table.open_api_states``: an unusable RESPONSES_STORE_PATH stops the start with
a ConfigError naming it), hands it to the routes in ``RouteContext.apis`` and closes it at shutdown.

``Responses`` holds ``store`` (``llm_api.protocols.responses.store``: finished responses, bounded) and
``in_flight`` (response id -> ``InFlightResponse``: its owner, the service's request id that ``cancel`` ends,
its encoder, whose Response object so far ``retrieve`` returns, and an event set when it ended), and
``background`` (the tasks running background responses: held here so none is collected while it runs; each
ends with its generation, which the engine's shutdown ends). Only the event loop touches these.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from llm_api.model.settings import Settings
from llm_api.protocols.responses.store import ResponseStore, open_response_store


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

    def close(self) -> None:
        self.store.close()


def open_responses(settings: Settings) -> Responses:
    return Responses(open_response_store(settings))
