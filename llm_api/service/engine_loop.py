"""EngineLoop: the one owner of the engine, stepping it on its own thread, fed by messages.

The engine core (``LLMEngine``, or the ``generate()`` reference core) is not thread-safe, so nothing but
this loop's thread touches it: callers submit ``_Add`` and ``_Abort`` messages, which the thread applies
between steps (and, for the reference core, between the token steps of its batch). The thread steps
while there is work and sleeps on a condition when idle. Outputs reach each request's ``asyncio.Queue``
through ``loop.call_soon_threadsafe``; after every step the loop publishes a snapshot of the engine's
stats (``stats``) and the time it last made progress, so readers (metrics, health) never touch the core.

``generate()`` raises the core's refusal (bad input, prompt too long) before yielding anything; if a step
raises, every stream in the engine ends with that error and their requests are aborted, so no stream
hangs; once idle for the delay the core names (``idle_work_delay``), the thread runs the core's idle work
(``LLMEngine``: re-measuring its CPU step budget), which stops early when a request arrives (the
request waits for one probe chunk at most); if the
consumer stops iterating or is cancelled, its request is aborted in a ``finally``. A request with
``params.n`` > 1 has one stream carrying the outputs of all its sequences (each with its ``index``); it ends
when all n have finished.

Threads: with GNU OpenMP, a thread that first enters a parallel region becomes the master of its own
team, sized from its own copy of the thread-count setting; the loop thread sets torch's thread count
again when it starts, so the model runs on every core the process was given (see docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Protocol

import torch

from llm_api.engine.request import RequestOutput
from llm_api.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineCore(Protocol):
    def add_request(self, request_id: str, prompt_token_ids: list[int] | None, params: SamplingParams,
                    prompt_embeds: torch.Tensor | None = None, lora_id: int = 0, priority: int = 0,
                    owner: str = "") -> None: ...

    def abort_request(self, request_id: str, index: int | None = None) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def run_step(self, on_outputs) -> None: ...

    def stats(self) -> Any: ...

    # Optional (``LLMEngine``): work the core does only while idle (re-measuring its CPU step budget).
    # idle_work_delay() -> seconds of idleness before idle_work() is due, or None;
    # idle_work(interrupted) -> None, returning soon once interrupted() (a message is waiting) is true.


class EngineDeadError(RuntimeError):
    """The engine was shut down (or its thread died) before the request finished."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput items, or one BaseException that ends the stream
    num_unfinished: int = 1  # sequences of the request still running (n); owned by the engine thread

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the consumer's loop is closed: nobody is listening any more


@dataclass
class _Abort:
    request_id: str
    stream: _Stream | None = None  # set: abort only the request this stream was added as
    index: int | None = None  # set: only this choice of the request


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int] | None
    params: SamplingParams
    prompt_embeds: torch.Tensor | None
    stream: _Stream
    added: asyncio.Future  # resolved (or failed) once add_request ran on the engine thread
    lora_id: int = 0  # the LoRA adapter it runs under (0: the base model)
    priority: int = 0  # lower first (SCHEDULING_POLICY=priority)
    owner: str = ""  # whose share of the engine it runs in (llm_api.engine.fair_share)


class EngineLoop:
    def __init__(self, core: EngineCore, num_threads: int | None = None):
        self.core = core
        self.stats = core.stats()  # the latest snapshot (None for a core without a paged cache)
        self.last_progress = time.monotonic()  # when a step last produced output (or the loop went idle)
        self._num_threads = num_threads or torch.get_num_threads()
        self._streams: dict[str, _Stream] = {}  # owned by the engine thread
        self._commands: list[_Add | _Abort] = []
        self._wakeup = threading.Condition()
        self._shutdown = False
        self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._shutdown

    # ----------------------------------------------------------------- caller side

    async def generate(self, request_id: str, prompt_token_ids: list[int] | None, params: SamplingParams,
                       prompt_embeds: torch.Tensor | None = None, lora_id: int = 0,
                       priority: int = 0, owner: str = "") -> AsyncGenerator[RequestOutput, None]:
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), params.n)
        added = loop.create_future()
        self._submit(_Add(request_id, prompt_token_ids, params, prompt_embeds, stream, added, lora_id, priority, owner))
        finished = False
        num_unfinished = params.n
        try:
            await added  # add_request's error surfaces here, before any output
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                num_unfinished -= item.finished
                finished = num_unfinished == 0
                yield item
                if finished:
                    return
        finally:
            if not finished:
                # Conditional: a failed add (e.g. a duplicate id) must not abort the other request.
                self._submit(_Abort(request_id, stream), during_shutdown=True)

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Abort from any thread: applied between steps, frees the request's blocks (or only those of its
        choice ``index``, which then reports an aborted output)."""
        self._submit(_Abort(request_id, index=index), during_shutdown=True)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        with self._wakeup:
            self._shutdown = True
            self._wakeup.notify()
        self._thread.join(timeout)

    def _submit(self, command, during_shutdown: bool = False) -> None:
        with self._wakeup:
            if self._shutdown:
                if during_shutdown:
                    return  # nothing left to abort
                raise EngineDeadError("the engine is shut down")
            self._commands.append(command)
            self._wakeup.notify()

    # ----------------------------------------------------------------- engine thread

    def _run(self) -> None:
        torch.set_num_threads(self._num_threads)  # this thread's OpenMP team (module docstring)
        try:
            while True:
                idle_work_due = False
                with self._wakeup:
                    while not (self._commands or self._shutdown or self.core.has_unfinished_requests()):
                        self.last_progress = time.monotonic()  # idle is not stalled
                        delay = self._idle_work_delay()
                        if not self._wakeup.wait(delay) and delay is not None:  # idle for that long
                            idle_work_due = not (self._commands or self._shutdown)
                            break
                    if self._shutdown:
                        break
                    commands, self._commands = self._commands, []
                if idle_work_due:
                    self._idle_work()
                    continue
                for command in commands:
                    self._apply(command)
                if self.core.has_unfinished_requests():
                    self._step()
                self.stats = self.core.stats()
        finally:
            dead = EngineDeadError("the engine is shut down")
            self._end_streams(dead)
            with self._wakeup:
                self._shutdown = True  # later submits fail at once instead of waiting forever
                pending, self._commands = self._commands, []
            for command in pending:
                if isinstance(command, _Add):
                    _resolve(command.stream.loop, command.added, dead)

    def _idle_work_delay(self) -> float | None:
        delay = getattr(self.core, "idle_work_delay", None)
        return delay() if delay is not None else None

    def _idle_work(self) -> None:
        try:
            # (only called when idle_work_delay exists; the list is read without the lock: a stale answer
            # costs one more probe chunk, never a lost message)
            self.core.idle_work(lambda: bool(self._commands or self._shutdown))  # type: ignore[attr-defined]
        except Exception:  # idle work only improves the core: a failure must not stop serving
            logger.exception("idle work failed")
        self.stats = self.core.stats()
        self.last_progress = time.monotonic()

    def _apply(self, command) -> None:
        if isinstance(command, _Abort):
            if command.stream is None or self._streams.get(command.request_id) is command.stream:
                self.core.abort_request(command.request_id, command.index)
            return
        try:
            # (lora_id, priority and owner only when set: a core without adapters, priorities or owners need not
            # take them)
            extra: dict = {"lora_id": command.lora_id} if command.lora_id else {}
            extra |= {"priority": command.priority} if command.priority else {}
            extra |= {"owner": command.owner} if command.owner else {}
            self.core.add_request(command.request_id, command.prompt_token_ids, command.params,
                                  command.prompt_embeds, **extra)
        except Exception as error:  # bad input: this caller's problem only
            _resolve(command.stream.loop, command.added, error)
            return
        self._streams[command.request_id] = command.stream
        _resolve(command.stream.loop, command.added, None)

    def _apply_aborts(self) -> None:
        """Aborts that arrived during a step, of requests already added; adds wait for the next one (the
        reference core runs a whole batch per step and calls back between its token steps). An abort whose
        request's add is still queued stays behind that add: applied first, it would find nothing, and the
        add would then start a request nobody reads (a caller whose deadline passed during a long step),
        running to max_new_tokens and starving the others."""
        with self._wakeup:
            now = [c for c in self._commands if isinstance(c, _Abort) and c.request_id in self._streams]
            self._commands = [c for c in self._commands if not any(c is a for a in now)]
        for command in now:
            self._apply(command)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self.stats = self.core.stats()  # before the outputs: a reader woken by them sees this step's state
        if outputs:
            self.last_progress = time.monotonic()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # its consumer already left (the abort came from its finally)
            stream.put(output)
            if output.finished:
                stream.num_unfinished -= 1
                if stream.num_unfinished == 0:
                    del self._streams[output.request_id]
        self._apply_aborts()

    def _step(self) -> None:
        try:
            self.core.run_step(self._deliver)
        except Exception as error:
            logger.exception("engine step failed; ending %d streams", len(self._streams))
            # The core may be mid-step: abort every request it knows so its blocks are freed.
            for request_id in list(self._streams):
                self.core.abort_request(request_id)
            if self.core.has_unfinished_requests():
                self.core.run_step(lambda outputs: None)  # drains the abort notices; schedules nothing
            self._end_streams(error)

    def _end_streams(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, error: BaseException | None) -> None:
    def settle():
        if future.done():
            return  # the caller was cancelled while waiting
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass
