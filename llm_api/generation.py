"""What every generation path shares: a job in, token-id steps out.

A ``GenerationJob`` is one validated request reduced to what a model needs (prompt token ids or
prompt embeddings, and sampling parameters). A path runs a list of jobs and reports every step as a
list of ``RequestOutput``s through a callback, which may call ``abort(request_id)`` to end a job early
(a stop string matched, a deadline passed). Two paths speak this interface:

* ``EnginePath``: the paged engine, stepped until the given jobs finish (classic TorchServe batches);
* ``llm_api.reference.ReferenceGenerator``: one transformers ``generate()`` call per batch.

``stream_async`` runs one job of any path on a worker thread and yields its outputs to asyncio code;
the async handler uses it when the engine cannot drive the model.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol, Sequence

import torch

from llm_api.engine.engine import LLMEngine
from llm_api.engine.request import RequestOutput
from llm_api.sampling import SamplingParams

__all__ = ["GenerationJob", "RequestOutput", "OnStep", "GenerationPath", "EnginePath", "stream_async"]


@dataclass
class GenerationJob:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int] | None = None
    prompt_embeds: torch.Tensor | None = None  # [T, H], on the model's input device and dtype

    @property
    def prompt_len(self) -> int:
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return int(self.prompt_embeds.shape[0])


OnStep = Callable[[Sequence[RequestOutput]], None]


class GenerationPath(Protocol):
    def run(self, jobs: Sequence[GenerationJob], on_step: OnStep) -> None: ...

    def abort(self, request_id: str) -> None: ...


class EnginePath:
    """The paged engine driven synchronously over one batch of jobs."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def run(self, jobs: Sequence[GenerationJob], on_step: OnStep) -> None:
        batch = [(j.request_id, j.prompt_token_ids, j.params, j.prompt_embeds) for j in jobs]
        for outputs in self.engine.generate_batch_stream(batch):
            on_step(outputs)

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)


async def stream_async(path: GenerationPath, job: GenerationJob, lock: threading.Lock) -> AsyncIterator[RequestOutput]:
    """Run one job on a thread (one at a time under ``lock``) and yield its outputs as they come."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def on_step(outputs: Sequence[RequestOutput]) -> None:
        for out in outputs:
            loop.call_soon_threadsafe(queue.put_nowait, out)

    def run() -> None:
        with lock:
            path.run([job], on_step)

    task = loop.run_in_executor(None, run)
    finished = False
    try:
        while not finished:
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait([getter, task], return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                task.result()  # the run ended without a final output: raise its error
                raise RuntimeError("generation ended without a final output")
            out = getter.result()
            finished = out.finished
            yield out
    finally:
        if not finished:
            path.abort(job.request_id)
