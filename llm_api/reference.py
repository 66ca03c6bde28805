"""The reference generation path: one transformers ``generate()`` call per batch.

This is the path the paged engine is tested against, and the fallback for models the engine cannot
drive. A batch is left-padded (token ids, or embeddings when any job brings ``inputs_embeds``) and run
by one ``generate()`` call. Requests in the batch may differ in every sampling parameter:

* ``RowSampler`` (a logits processor) picks each row's token with the shared ``Sampler`` and the
  request's own RNG, then hands ``generate()`` a one-hot score row, so ``generate()`` runs greedy and
  simply takes that token. An all-greedy batch without penalties skips it: plain ``generate()``.
* ``StepReporter`` (a stopping criterion, called once per step with the new tokens in every
  transformers version we support) decides per row when it is done (EOS, its own ``max_new_tokens``,
  an abort) and reports each step's tokens to the caller.

The whole batch ends when its slowest row ends: the cost the paged engine removes.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from llm_api.engine.kv_cache import execution_device
from llm_api.generation import GenerationJob, OnStep, RequestOutput
from llm_api.sampling import Sampler, SamplerBatch, SamplingState

logger = logging.getLogger(__name__)


class ReferenceGenerator:
    def __init__(self, model, eos_token_ids: frozenset[int], pad_token_id: int):
        self._model = model
        self._eos = eos_token_ids
        self._pad = pad_token_id
        # Where input ids go: not the weight's device, which is "meta" for an offloaded embedding.
        self._device = execution_device(model, model.get_input_embeddings())
        self._reporter: StepReporter | None = None

    def abort(self, request_id: str) -> None:
        if self._reporter is not None:
            self._reporter.abort(request_id)

    @torch.inference_mode()
    def run(self, jobs: Sequence[GenerationJob], on_step: OnStep) -> None:
        if not jobs:
            return
        inputs = self._pack(jobs)
        reporter = StepReporter(jobs, self._eos, on_step)
        processors = LogitsProcessorList()
        if any(not j.params.greedy or j.params.needs_penalty for j in jobs):
            processors.append(RowSampler(jobs, self._device))
        self._reporter = reporter
        try:
            self._model.generate(
                **inputs,
                max_new_tokens=max(j.params.max_new_tokens for j in jobs),
                do_sample=False,
                logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([reporter]),
                pad_token_id=self._pad,
                # EOS is decided per row by StepReporter (a row may set ignore_eos).
                eos_token_id=None,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        finally:
            self._reporter = None
        reporter.finish_remaining()

    def _pack(self, jobs: Sequence[GenerationJob]) -> dict:
        """Left-pad the batch: ids [B, Lmax] (or embeds [B, Lmax, H]) and attention_mask [B, Lmax]."""
        max_len = max(j.prompt_len for j in jobs)
        mask = torch.zeros(len(jobs), max_len, dtype=torch.long, device=self._device)
        for row, job in enumerate(jobs):
            mask[row, max_len - job.prompt_len :] = 1
        if all(j.prompt_token_ids is not None for j in jobs):
            ids = torch.full((len(jobs), max_len), self._pad, dtype=torch.long, device=self._device)
            for row, job in enumerate(jobs):
                ids[row, max_len - job.prompt_len :] = torch.tensor(job.prompt_token_ids, device=self._device)
            return {"input_ids": ids, "attention_mask": mask}
        embed = self._model.get_input_embeddings()
        embeds = torch.zeros(len(jobs), max_len, embed.embedding_dim, dtype=embed.weight.dtype, device=self._device)
        for row, job in enumerate(jobs):
            if job.prompt_embeds is not None:
                row_embeds = job.prompt_embeds
            else:
                row_embeds = embed(torch.tensor(job.prompt_token_ids, device=self._device))
            embeds[row, max_len - job.prompt_len :] = row_embeds.to(embeds.dtype)
        return {"inputs_embeds": embeds, "attention_mask": mask}


class RowSampler(LogitsProcessor):
    """Per-row sampling inside one ``generate()`` call: scores [B, V] -> one-hot rows of the picks."""

    def __init__(self, jobs: Sequence[GenerationJob], device: torch.device):
        self._jobs = jobs
        self._sampler = Sampler()
        self._states = [SamplingState.for_params(j.params, device) for j in jobs]
        self._generated: list[list[int]] = [[] for _ in jobs]
        self._first = True

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self._first:  # the previous step's picks are now the last column of input_ids
            for row, token in enumerate(input_ids[:, -1].tolist()):
                self._generated[row].append(token)
        self._first = False
        seen = [
            (j.prompt_token_ids or []) + gen if j.params.needs_penalty else None
            for j, gen in zip(self._jobs, self._generated)
        ]
        picks = self._sampler(scores, SamplerBatch([j.params for j in self._jobs], self._states, seen))
        one_hot = torch.full_like(scores, float("-inf"))
        one_hot.scatter_(1, picks.view(-1, 1), 0.0)
        return one_hot


class StepReporter(StoppingCriteria):
    """Per-row stop decisions and step reports; returns [B] bools (True: this row is done)."""

    def __init__(self, jobs: Sequence[GenerationJob], eos: frozenset[int], on_step: OnStep):
        self._jobs = jobs
        self._eos = eos
        self._on_step = on_step
        self._num_generated = [0] * len(jobs)
        self._done = [False] * len(jobs)
        self._aborted: set[str] = set()

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        new_tokens = input_ids[:, -1].tolist()
        outputs = []
        for row, job in enumerate(self._jobs):
            if self._done[row]:
                continue
            if job.request_id in self._aborted:
                self._done[row] = True
                outputs.append(RequestOutput(job.request_id, [], True, "abort"))
                continue
            token = new_tokens[row]
            self._num_generated[row] += 1
            reason = None
            if token in self._eos and not job.params.ignore_eos:
                reason = "stop"
            elif self._num_generated[row] >= job.params.max_new_tokens:
                reason = "length"
            self._done[row] = reason is not None
            outputs.append(RequestOutput(job.request_id, [token], reason is not None, reason))
        if outputs:
            self._on_step(outputs)
        # Aborts requested inside on_step take effect now, not one step later.
        for row, job in enumerate(self._jobs):
            if not self._done[row] and job.request_id in self._aborted:
                self._done[row] = True
                self._on_step([RequestOutput(job.request_id, [], True, "abort")])
        return torch.tensor(self._done, dtype=torch.bool, device=input_ids.device)

    def finish_remaining(self) -> None:
        """Rows still open when generate() returned (it stopped at its own length limit)."""
        rest = [RequestOutput(j.request_id, [], True, "length") for row, j in enumerate(self._jobs) if not self._done[row]]
        if rest:
            self._on_step(rest)
