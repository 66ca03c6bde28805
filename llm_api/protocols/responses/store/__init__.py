"""Stored responses: what the Responses API keeps for ``store: true`` (OpenAI's default), bounded.

One interface (``ResponseStore``, ``.interface``: what an entry holds, the bounds, owners and background
claims both stores keep), two stores: ``MemoryResponseStore`` (``.memory``, the default: gone at restart)
and ``SqliteResponseStore`` (``.sqlite``, ``RESPONSES_STORE_PATH``: one SQLite file, so stored responses
survive a restart and the TorchServe workers of one model share them). ``open_response_store(settings)``
picks one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from llm_api.model.settings import Settings
from llm_api.protocols.responses.store.interface import Clock, ResponseStore, StoreLimits
from llm_api.protocols.responses.store.memory import MemoryResponseStore
from llm_api.protocols.responses.store.sqlite import SqliteResponseStore

logger = logging.getLogger(__name__)

# How often the periodic sweep runs at most (and at least once per TTL).
SWEEP_EVERY_S = 60.0


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
