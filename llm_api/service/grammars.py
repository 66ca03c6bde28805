"""Grammar compilation for structured-output requests: off the event loop, off the engine thread, bounded.

``GrammarCompilation.compile(constraint, deadline)`` turns a request's ``Constraint`` into the
``CompiledGrammar`` its ``SamplingParams.grammar`` carries to the engine, or raises ``ApiError``:

* a spec compiled before is answered from the compiler's cache on the event loop, at once;
* any other runs on a small thread pool of its own (``num_workers``; xgrammar releases the GIL while it
  compiles and uses ``threads_per_compile`` threads of its own), never on the event loop (other requests'
  chunks keep flowing) nor on the engine thread (other requests' tokens keep coming: a slow compile
  delays only its own request);
* at most ``max_pending`` compilations are queued or running; beyond that a request gets 503
  ``overloaded`` at once (a compile cannot be interrupted, so the queue is what bounds the wait). A
  request whose deadline passes while its grammar compiles gets 408 ``timeout``; the compile finishes
  on the pool and its result is cached;
* a spec the library rejects, or one over the compile-cost limits (``llm_api.engine.grammar``), gets
  400 ``invalid_grammar`` naming the request field; for a grammar built from several schemas (tools),
  the one at fault is found and named (``tools[2].function.parameters``).

The compiler (xgrammar's tokenizer table, about a second for a 50k vocabulary) is built on the pool by
the first request that needs it, so a server that never sees structured output never pays for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from llm_api.api.constraints import grammar_refusal
from llm_api.api.errors import ApiError
from llm_api.api.request import Constraint
from llm_api.engine.grammar import CompiledGrammar, GrammarCompiler, GrammarError

logger = logging.getLogger(__name__)

MAX_PENDING_COMPILES = 16


def default_num_workers() -> int:
    # Compiles share the CPU with the engine thread: one at a time on small machines.
    return max(1, (os.cpu_count() or 2) // 8)


class GrammarCompilation:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, *, num_workers: int | None = None,
                 max_pending: int = MAX_PENDING_COMPILES, threads_per_compile: int | None = None):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._threads_per_compile = threads_per_compile
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(num_workers or default_num_workers(), thread_name_prefix="llm-grammar")
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._pending = 0  # compilations queued or running (event-loop side count)
        self._pending_lock = threading.Lock()

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
        return self._pending

    async def compile(self, constraint: Constraint, deadline: float | None = None) -> CompiledGrammar:
        compiler = self._compiler
        if compiler is not None:
            compiled = compiler.cached(constraint.spec)
            if compiled is not None:
                return compiled
        with self._pending_lock:
            if self._pending >= self.max_pending:
                raise ApiError(503, "overloaded", f"the server is busy: {self._pending} grammars are compiling "
                               f"(at most {self.max_pending}); retry later")
            self._pending += 1
        future = self._pool.submit(self._compile, constraint)
        future.add_done_callback(self._done)
        try:
            remaining = None if deadline is None else deadline - time.monotonic()
            async with asyncio.timeout(remaining):
                return await asyncio.wrap_future(future)
        except TimeoutError:
            raise ApiError(408, "timeout", "the request exceeded its deadline while its grammar compiled") from None
        except _Refused as refused:
            raise grammar_refusal(refused.param, refused.error) from None

    def _done(self, _future) -> None:
        with self._pending_lock:
            self._pending -= 1

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
