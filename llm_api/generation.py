"""What every generation path shares: a job in, token-id steps out.

A ``GenerationJob`` is one validated request reduced to what a model needs (prompt token ids or
prompt embeddings, and sampling parameters). A path runs a list of jobs and reports every step as a
list of ``StepOutput``s through a callback, which may call ``abort(key)`` to end a job early (a stop
string matched, a deadline passed). Both the ``generate()`` reference and the paged engine's batch mode
speak this interface, so the handler streams from either the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from llm_api.sampling import SamplingParams


@dataclass
class GenerationJob:
    key: str
    params: SamplingParams
    prompt_token_ids: list[int] | None = None
    prompt_embeds: torch.Tensor | None = None  # [T, H], on the model's input device and dtype

    @property
    def prompt_len(self) -> int:
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return int(self.prompt_embeds.shape[0])


@dataclass
class StepOutput:
    key: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"


OnStep = Callable[[Sequence[StepOutput]], None]


class GenerationPath(Protocol):
    def run(self, jobs: Sequence[GenerationJob], on_step: OnStep) -> None: ...

    def abort(self, key: str) -> None: ...
