"""The served adapters and the MAX_LORAS slots their weights occupy during a step.

``LoraRegistry`` wraps the model's target linears once (``layer.wrap_targets``), keeps every loaded
adapter's weights on the host (``config.load_adapter``: checked against those linears), and on each step
(``step``, engine thread) puts the step's adapters into slots 1..MAX_LORAS: an adapter already resident
stays, one that is not takes a free slot or the least recently used slot of an adapter this step does
not use, its weights copied to the modules' devices (a swap: counted and timed, for ``bench/lora.py`` and
the metrics). The scheduler never runs more than MAX_LORAS adapters at once (``SchedulerConfig.max_loras``),
so a step always finds slots. Slot 0 is the base model.

Each load gets a fresh ``lora_id``: slots and prefix-cache keys use it, not the name, so an adapter
unloaded and loaded again under the same name never reuses the old one's slot contents or KV blocks.

``load_under_root`` is the runtime route's load (LORA_RUNTIME_LOADING): the path is resolved, symlinks
included, and must stay inside LORA_ADAPTER_ROOT, as must each file read from it; nothing is downloaded.
``unload`` refuses an adapter that live requests still use (the service counts them).

Thread-safety: the event loop loads and unloads while the engine thread steps; one lock covers the
tables. An adapter unloaded while an aborted request of it is still in the engine's queue runs that
request's last step on the base weights (its output is discarded).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from llm_api.lora.config import AdapterError, LoraAdapter, WEIGHTS_FILE, CONFIG_FILE, check_adapter_name, load_adapter
from llm_api.lora.context import LoraStep
from llm_api.lora.layer import LoraLinear, wrap_targets

logger = logging.getLogger(__name__)


class AdapterInUseError(AdapterError):
    """An unload asked for an adapter that live requests still use."""


class AdapterPathError(AdapterError):
    """A runtime load named a path outside LORA_ADAPTER_ROOT (or one that does not exist there)."""


@dataclass(frozen=True)
class LoraStats:
    max_loras: int
    resident: tuple[str, ...]  # adapter names in slots now
    num_swaps: int  # adapters copied into a slot since start
    swap_seconds: float  # time spent copying them


class LoraRegistry:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, model_name: str | None = None):
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_rank must be >= 1")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.model_name = model_name
        self.modules: dict[str, LoraLinear] = wrap_targets(model, max_loras)
        if not self.modules:
            raise AdapterError(f"{type(model).__name__} has no q/k/v/o/gate/up/down projection LoRA can adapt")
        self.targets = {path: (m.in_features, m.out_features) for path, m in self.modules.items()}
        self._devices = {path: _device_of(m.base) for path, m in self.modules.items()}
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self._lock = threading.Lock()
        self._by_name: dict[str, LoraAdapter] = {}
        self._by_id: dict[int, LoraAdapter] = {}
        self._ids = itertools.count(1)
        self._slot_owner = [0] * (max_loras + 1)  # slot -> lora_id (0: free; slot 0 is the base model)
        self._slot_used = [0] * (max_loras + 1)  # slot -> step counter of its last use (LRU)
        self._resident: list[LoraAdapter | None] = [None] * (max_loras + 1)  # slot -> the adapter in it
        self._layout_version = 0
        self._num_steps = 0
        self._num_swaps = 0
        self._swap_seconds = 0.0

    # ---------------------------------------------------------------- adapters

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Read, check and register an adapter (AdapterError naming it and the reason)."""
        check_adapter_name(name)
        with self._lock:
            if name in self._by_name:
                raise AdapterError(f"LoRA adapter {name!r} is already loaded")
        adapter = load_adapter(name, path, self.targets, self.max_rank, self.dtype, self.model_name)
        with self._lock:
            if name in self._by_name:
                raise AdapterError(f"LoRA adapter {name!r} is already loaded")
            adapter = replace(adapter, lora_id=next(self._ids))
            self._by_name[name] = adapter
            self._by_id[adapter.lora_id] = adapter
        logger.info("LoRA adapter %s loaded: rank %d, %d modules, %.2f MiB", name, adapter.rank,
                    len(adapter.modules), adapter.num_bytes / 2**20)
        return adapter

    def load_under_root(self, name: str, path: str, root: str) -> LoraAdapter:
        return self.load(name, confined_path(path, root))

    def unload(self, name: str, in_use: int = 0) -> LoraAdapter:
        with self._lock:
            adapter = self._by_name.get(name)
            if adapter is None:
                raise KeyError(name)
            if in_use:
                raise AdapterInUseError(f"LoRA adapter {name!r} has {in_use} requests running; unload it once "
                                        f"they finished")
            del self._by_name[name]
            del self._by_id[adapter.lora_id]
            # Its slot is freed by the next step (the engine thread owns the slot contents).
        logger.info("LoRA adapter %s unloaded", name)
        return adapter

    def get(self, name: str) -> LoraAdapter | None:
        return self._by_name.get(name)

    def adapters(self) -> list[LoraAdapter]:
        with self._lock:
            return sorted(self._by_name.values(), key=lambda a: a.lora_id)

    def name_of(self, lora_id: int) -> str | None:
        adapter = self._by_id.get(lora_id)
        return adapter.name if adapter is not None else None

    # ---------------------------------------------------------------- steps (engine thread)

    def step(self, ranges: Sequence[tuple[int, int, int]], num_tokens: int, device: torch.device) -> LoraStep | None:
        """``ranges``: (lora_id, start, end) of each scheduled request's packed tokens -> the step's rows
        by slot (None when no row uses an adapter)."""
        if not any(lora_id for lora_id, _, _ in ranges):
            return None
        with self._lock:
            self._num_steps += 1
            slot_of = self._assign({lora_id for lora_id, _, _ in ranges if lora_id})
            columns, scalings, version = self._columns()
        return LoraStep.build([(slot_of.get(lora_id, 0), start, end) for lora_id, start, end in ranges],
                              num_tokens, device, self.dtype, columns, scalings, version)

    def _columns(self) -> tuple[list[tuple[int, int]], list[float], int]:
        """Each slot's (offset, width) in the concatenated rank columns, the slots' scalings, and the
        layout's version (it changes whenever a slot is refilled)."""
        columns, scalings, offset = [(0, 0)], [0.0], 0
        for slot in range(1, self.max_loras + 1):
            adapter = self._resident[slot]
            width = adapter.rank if adapter is not None else 0
            columns.append((offset, width))
            scalings.append(adapter.scaling if adapter is not None else 0.0)
            offset += width
        return columns, scalings, self._layout_version

    def _assign(self, wanted: set[int]) -> dict[int, int]:
        owners = self._slot_owner
        for slot in range(1, self.max_loras + 1):  # slots of unloaded adapters are free again
            if owners[slot] and owners[slot] not in self._by_id and owners[slot] not in wanted:
                self._fill(slot, None)
        slot_of = {owners[s]: s for s in range(1, self.max_loras + 1) if owners[s] in wanted}
        for lora_id in sorted(wanted - slot_of.keys()):
            adapter = self._by_id.get(lora_id)
            if adapter is None:
                continue  # unloaded under an aborted request: its rows run on the base weights
            free = [s for s in range(1, self.max_loras + 1) if owners[s] not in wanted]
            if not free:
                raise RuntimeError(f"a step uses more than MAX_LORAS={self.max_loras} adapters")
            slot = min(free, key=lambda s: (owners[s] != 0, self._slot_used[s]))
            self._fill(slot, adapter)
            slot_of[lora_id] = slot
        for slot in slot_of.values():
            self._slot_used[slot] = self._num_steps
        return slot_of

    def _fill(self, slot: int, adapter: LoraAdapter | None) -> None:
        started = time.perf_counter()
        for path, module in self.modules.items():
            weights = adapter.modules.get(path) if adapter is not None else None
            if weights is None:
                module.slots.set(slot, None, None, 0.0)
            else:
                device = self._devices[path]
                module.slots.set(slot, weights.a.to(device, non_blocking=True), weights.b.to(device, non_blocking=True),
                                 adapter.scaling if adapter is not None else 0.0)
        self._slot_owner[slot] = adapter.lora_id if adapter is not None else 0
        self._resident[slot] = adapter
        self._layout_version += 1
        if adapter is not None:
            self._num_swaps += 1
            self._swap_seconds += time.perf_counter() - started

    def stats(self) -> LoraStats:
        with self._lock:
            resident = tuple(a.name for s in range(1, self.max_loras + 1)
                             if (a := self._by_id.get(self._slot_owner[s])) is not None)
            return LoraStats(self.max_loras, resident, self._num_swaps, self._swap_seconds)


def _device_of(module: nn.Module) -> torch.device:
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def confined_path(path: str, root: str) -> Path:
    """``path`` (relative to ``root``, or absolute) resolved with its symlinks; AdapterPathError unless it
    and the adapter files in it lie inside ``root``."""
    if not root:
        raise AdapterPathError("LORA_ADAPTER_ROOT is not set: runtime loading has no folder to load from")
    if not isinstance(path, str) or not path or "\0" in path or len(path) > 4096:
        raise AdapterPathError("lora_path must be a non-empty path")
    base = Path(root).resolve()
    candidate = Path(path) if Path(path).is_absolute() else base / path
    try:
        resolved = candidate.resolve(strict=True)
    except (OSError, RuntimeError):
        raise AdapterPathError("lora_path does not name a folder under LORA_ADAPTER_ROOT") from None
    if not resolved.is_relative_to(base) or not resolved.is_dir():
        raise AdapterPathError("lora_path does not name a folder under LORA_ADAPTER_ROOT")
    for file_name in (CONFIG_FILE, WEIGHTS_FILE):
        file_path = resolved / file_name
        if file_path.exists() and not file_path.resolve().is_relative_to(base):
            raise AdapterPathError(f"{file_name} in lora_path links outside LORA_ADAPTER_ROOT")
    return resolved
