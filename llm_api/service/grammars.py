"""Grammar compilation for structured-output requests: off the event loop, off the engine thread, bounded,
and shared fairly between the keys that ask for it.

``GrammarCompilation.compile(constraint, deadline, owner)`` turns a request's ``Constraint`` into the
``CompiledGrammar`` its ``SamplingParams.grammar`` carries to the engine, or raises ``ApiError``:

* a spec compiled before is answered from the compiler's cache on the event loop, at once: it never waits
  behind another request's compile;
* any other runs on a small thread pool of its own (``num_workers``; xgrammar releases the GIL while it
  compiles and uses ``threads_per_compile`` threads of its own), never on the event loop (other requests'
  chunks keep flowing) nor on the engine thread (other requests' tokens keep coming);
* **fair shares**: at most ``max_pending`` compilations are queued or running in all, and at most
  ``max_pending_per_owner`` (a quarter of them) for one owner (the key that sent the request,
  ``llm_api.service.owners``); beyond either a request gets 503 ``overloaded`` with ``Retry-After`` at once
  (a compile cannot be interrupted, so the queue is what bounds the wait). Queued compiles start in turn by
  owner (round robin), so one key's queue delays another key's compile by at most one compile per worker;
* **within the request's deadline**: the time spent queued and compiling counts against the request's
  ``timeout``. A request whose deadline the compiles ahead of it would already pass (their number times the
  recent compile time) gets 503 with ``Retry-After`` at once rather than a 408 after waiting; one whose
  deadline passes while queued is dropped from the queue (408 ``timeout``); one whose deadline passes while
  compiling gets 408 and the compile finishes on the pool, its result cached;
* a spec the library rejects, or one over the compile-cost limits (``llm_api.structured.spec``), gets
  400 ``invalid_grammar`` naming the request field; for a grammar built from several schemas (tools),
  the one at fault is found and named (``tools[2].function.parameters``).

The red team's flood (24 requests of one key at once, each with its own small schema, ~7 s of compile each)
made the 16th accepted request wait 120.7 s; now that key gets 4 compiles and 20 quick 503s, and another
key's request is served beside them (tests/test_hostile_grammar.py).

The compiler (xgrammar's tokenizer table, about a second for a 50k vocabulary) is built on the pool by
the first request that needs it, so a server that never sees structured output never pays for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from llm_api.errors import ApiError
from llm_api.service.constraints import grammar_refusal
from llm_api.structured.compiler import CompiledGrammar, GrammarCompiler
from llm_api.structured.spec import Constraint, GrammarError

logger = logging.getLogger(__name__)

MAX_PENDING_COMPILES = 16
INITIAL_COMPILE_S = 1.0  # the compile time assumed before any was measured (a small schema, 50k vocabulary)


def default_num_workers() -> int:
    # Compiles share the CPU with the engine thread: one at a time on small machines.
    return max(1, (os.cpu_count() or 2) // 8)


@dataclass(eq=False)
class _Job:
    constraint: Constraint
    owner: str
    deadline: float | None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class GrammarCompilation:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, *, num_workers: int | None = None,
                 max_pending: int = MAX_PENDING_COMPILES, max_pending_per_owner: int | None = None,
                 threads_per_compile: int | None = None):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._threads_per_compile = threads_per_compile
        self.max_pending = max_pending
        self.max_pending_per_owner = max_pending_per_owner or max(1, max_pending // 4)
        self._num_workers = num_workers or default_num_workers()
        self._pool = ThreadPoolExecutor(self._num_workers, thread_name_prefix="llm-grammar")
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the counts and the queue below
        self._pending: Counter[str] = Counter()  # owner -> compilations queued or running
        self._queue: dict[str, deque[_Job]] = {}  # owner -> queued jobs
        self._last_start: dict[str, int] = {}  # owner -> when a job of theirs last started (a counter)
        self._starts = 0
        self._recent_compile_s = INITIAL_COMPILE_S  # an average of recent compiles (the wait estimate)

    @property
    def compiler(self) -> GrammarCompiler:
        """The compiler, built on first use (blocking: call it off the event loop)."""
        with self._compiler_lock:
            if self._compiler is None:
                start = time.perf_counter()
                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._stop_token_ids,
                                                 num_threads=self._threads_per_compile)
                logger.info("grammar compiler ready in %.2f s (vocabulary %d)", time.perf_counter() - start,
                            self._vocab_size)
            return self._compiler

    @property
    def num_pending(self) -> int:
        return sum(self._pending.values())

    async def compile(self, constraint: Constraint, deadline: float | None = None, owner: str = "") -> CompiledGrammar:
        compiler = self._compiler
        if compiler is not None:
            compiled = compiler.cached(constraint.spec)
            if compiled is not None:
                return compiled
        job = self._enqueue(constraint, owner, deadline)
        try:
            remaining = None if deadline is None else deadline - time.monotonic()
            async with asyncio.timeout(remaining):
                return await asyncio.wrap_future(job.future)
        except TimeoutError:
            raise ApiError(408, "timeout", "the request exceeded its deadline while its grammar compiled") from None
        except _Refused as refused:
            raise grammar_refusal(refused.param, refused.error) from None

    def _enqueue(self, constraint: Constraint, owner: str, deadline: float | None) -> _Job:
        """Queue a compile (module docstring: shares and deadlines), or raise the 503."""
        with self._lock:
            total = sum(self._pending.values())
            wait_s = (total // self._num_workers + 1) * self._recent_compile_s
            retry_after = max(1, math.ceil(wait_s))
            if total >= self.max_pending:
                raise ApiError(503, "overloaded", f"the server is busy: {total} grammars are compiling (at most "
                               f"{self.max_pending}); retry later", retry_after=retry_after)
            if self._pending[owner] >= self.max_pending_per_owner:
                raise ApiError(503, "overloaded", f"this key has {self._pending[owner]} grammars compiling (at most "
                               f"{self.max_pending_per_owner} per key); retry when one is done",
                               retry_after=retry_after)
            if deadline is not None and time.monotonic() + wait_s > deadline:
                raise ApiError(503, "overloaded", f"the grammars compiling now would take about {wait_s:.0f} s, past "
                               "this request's deadline; retry later", retry_after=retry_after)
            job = _Job(constraint, owner, deadline)
            self._pending[owner] += 1
            self._queue.setdefault(owner, deque()).append(job)
        self._pool.submit(self._run_next)
        return job

    def _next_job(self) -> _Job | None:
        """The next queued job, owners in turn: the oldest job of the owner whose last compile started
        longest ago (an owner new to the queue first)."""
        with self._lock:
            while self._queue:
                owner = min(self._queue, key=lambda o: self._last_start.get(o, -1))
                jobs = self._queue[owner]
                job = jobs.popleft()
                if not jobs:
                    del self._queue[owner]
                self._starts += 1
                self._last_start[owner] = self._starts
                if len(self._last_start) > 4 * self.max_pending:  # (forget owners long gone)
                    for gone in [o for o in self._last_start if o not in self._pending][: len(self._last_start) // 2]:
                        del self._last_start[gone]
                if job.deadline is not None and time.monotonic() > job.deadline:  # (its request gave up: 408)
                    self._release(job.owner)
                    job.future.cancel()
                    continue
                return job
            return None

    def _run_next(self) -> None:
        """One pool task per queued job: runs whichever job is next in turn when a worker is free."""
        job = self._next_job()
        if job is None:
            return
        if not job.future.set_running_or_notify_cancel():
            self._release(job.owner)
            return
        start = time.perf_counter()
        result: CompiledGrammar | None = None
        error: BaseException | None = None
        try:
            result = self._compile(job.constraint)
        except BaseException as failure:  # (_Refused, or a library failure: the request's own error)
            error = failure
        with self._lock:
            self._recent_compile_s = 0.7 * self._recent_compile_s + 0.3 * (time.perf_counter() - start)
        self._release(job.owner)  # (before the result: its waiter, once woken, sees the place free)
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def _release(self, owner: str) -> None:
        with self._lock:
            self._pending[owner] -= 1
            if self._pending[owner] <= 0:
                del self._pending[owner]

    def _compile(self, constraint: Constraint) -> CompiledGrammar:
        try:
            compiled = self.compiler.compile(constraint.spec)
        except GrammarError as error:
            raise _Refused(*self._blame(constraint, error)) from None
        logger.info("grammar compiled for %s in %.3f s (%s)", constraint.param, compiled.compile_seconds,
                    constraint.spec.kind)
        return compiled

    def _blame(self, constraint: Constraint, error: GrammarError) -> tuple[str, GrammarError]:
        """The field at fault: the first part the library rejects on its own, else the constraint's field.
        (Runs only after a failure; each part's check is a cached compile of one schema.)"""
        for param, spec in constraint.parts:
            try:
                self.compiler.compile(spec)
            except GrammarError as part_error:
                return param, part_error
        return constraint.param, error

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Refused(Exception):
    def __init__(self, param: str, error: GrammarError):
        super().__init__(str(error))
        self.param = param
        self.error = error
