"""The reference generation core: transformers ``generate()``, one call per batch of waiting requests.

This is the path the paged engine is tested against, and the fallback for models the engine cannot
drive. It has the engine's interface (``add_request``, ``abort_request``, ``has_unfinished_requests``,
``run_step``), so the same engine loop drives either. ``run_step(on_outputs)`` runs every request
waiting at that moment as one left-padded batch (token ids, or embeddings when any request brings
``inputs_embeds``) through one ``generate()`` call, and reports each token step through ``on_outputs``
as it happens; requests added meanwhile wait for the next batch. ``abort_request`` from inside
``on_outputs`` ends a row at once. Requests in the batch may differ in every sampling parameter:

* ``RowSampler`` (a logits processor) picks each row's token with the shared ``Sampler`` and the
  request's own RNG (and its grammar's token mask, for structured output: each row has its own
  ``GrammarMatcher``, which it asks for the mask and then advances with the token), then hands
  ``generate()`` a one-hot score row, so ``generate()`` runs greedy and simply takes that token. An
  all-greedy batch without penalties or grammars skips it: plain ``generate()``.
* ``StepReporter`` (a stopping criterion, called once per step with the new tokens in every
  transformers version we support) decides per row when it is done (EOS, its own ``max_new_tokens``,
  an abort) and reports each step's tokens to the caller, with the logprobs ``RowSampler`` computed for
  that step when the request asked for them.

A request with ``n`` > 1 is n rows of the batch (``RequestOutput.index``), each with its own sampler
state; the prompt is simply repeated (no sharing: this path is the reference, not the fast one).

The whole batch ends when its slowest row ends: the cost the paged engine removes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence, cast

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from llm_api.engine.request import FinishReason, RequestOutput, TokenLogprob
from llm_api.engine.sampler import Sampler, SamplerBatch, SamplingState
from llm_api.engine.sampling_params import SamplingParams
from llm_api.model.placement import execution_device
from llm_api.structured.matcher import GrammarMatcher, advance, step_mask
from llm_api.layers.quantized import embedding_dtype

logger = logging.getLogger(__name__)

OnOutputs = Callable[[list[RequestOutput]], None]


@dataclass
class ReferenceRequest:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int] | None = None
    prompt_embeds: torch.Tensor | None = None  # [T, H]
    aborted: bool = False  # while waiting: reported as aborted by the next run_step
    index: int = 0  # choice index (a request with n > 1 is n rows)

    @property
    def prompt_len(self) -> int:
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        assert self.prompt_embeds is not None  # add_request takes ids or embeddings, exactly one
        return int(self.prompt_embeds.shape[0])


class ReferenceCore:
    def __init__(self, model, eos_token_ids: frozenset[int], pad_token_id: int):
        if not callable(getattr(model, "generate", None)):  # (our module tree: loaded for the paged engine)
            raise ValueError(f"the generate() reference path needs transformers' classes, which {type(model).__name__} "
                             f"is not: load the model with ENGINE=generate")
        self._model = model
        self._eos = eos_token_ids
        self._pad = pad_token_id
        # Where input ids go: not the weight's device, which is "meta" for an offloaded embedding.
        self._device = execution_device(model, model.get_input_embeddings())
        self._waiting: list[ReferenceRequest] = []
        self._reporter: StepReporter | None = None

    def add_request(self, request_id: str, prompt_token_ids: list[int] | None, params: SamplingParams,
                    prompt_embeds: torch.Tensor | None = None, lora_id: int = 0, priority: int = 0,
                    owner: str = "") -> None:
        """Queue a request's n rows for the next batch (``priority`` and ``owner`` change nothing: every
        waiting row runs in that batch)."""
        if lora_id:
            raise ValueError("the generate() reference path serves no LoRA adapters")
        if (prompt_token_ids is None) == (prompt_embeds is None):
            raise ValueError("give prompt_token_ids or prompt_embeds")
        if any(r.request_id == request_id for r in self._waiting):
            raise ValueError(f"request id {request_id!r} is already in use")
        self._waiting.extend(ReferenceRequest(request_id, params, prompt_token_ids, prompt_embeds, index=index)
                             for index in range(params.n))

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        """End a request (or only its choice ``index``): a waiting one is reported as aborted by the next
        ``run_step``; a running one at the batch's next token step."""
        if self._reporter is not None and self._reporter.abort(request_id, index):
            return
        for request in self._waiting:
            if request.request_id == request_id and index in (None, request.index):
                request.aborted = True

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting)

    def stats(self):
        return None  # no paged KV cache to report

    def run_step(self, on_outputs: OnOutputs) -> None:
        batch, self._waiting = self._waiting, []
        aborted = [r for r in batch if r.aborted]
        if aborted:
            on_outputs([RequestOutput(r.request_id, [], True, FinishReason.ABORT, r.index) for r in aborted])
        batch = [r for r in batch if not r.aborted]
        if batch:
            self._generate(batch, on_outputs)

    @torch.inference_mode()
    def _generate(self, batch: Sequence[ReferenceRequest], on_outputs: OnOutputs) -> None:
        inputs = self._pack(batch)
        processors = LogitsProcessorList()
        row_sampler = None
        if not all(r.params.argmax_only for r in batch):
            row_sampler = RowSampler(batch, self._device)
            processors.append(row_sampler)
        reporter = StepReporter(batch, self._eos, on_outputs, row_sampler)
        self._reporter = reporter
        try:
            self._model.generate(
                **inputs,
                max_new_tokens=max(r.params.max_new_tokens for r in batch),
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

    def _pack(self, batch: Sequence[ReferenceRequest]) -> dict:
        """Left-pad the batch: ids [B, Lmax] (or embeds [B, Lmax, H]) and attention_mask [B, Lmax]."""
        max_len = max(r.prompt_len for r in batch)
        mask = torch.zeros(len(batch), max_len, dtype=torch.long, device=self._device)
        for row, request in enumerate(batch):
            mask[row, max_len - request.prompt_len :] = 1
        if all(r.prompt_token_ids is not None for r in batch):
            ids = torch.full((len(batch), max_len), self._pad, dtype=torch.long, device=self._device)
            for row, request in enumerate(batch):
                ids[row, max_len - request.prompt_len :] = torch.tensor(request.prompt_token_ids, device=self._device)
            return {"input_ids": ids, "attention_mask": mask}
        embed = self._model.get_input_embeddings()
        embeds = torch.zeros(len(batch), max_len, embed.embedding_dim, dtype=embedding_dtype(embed), device=self._device)
        for row, request in enumerate(batch):
            if request.prompt_embeds is not None:
                row_embeds = request.prompt_embeds
            else:
                row_embeds = embed(torch.tensor(request.prompt_token_ids, device=self._device))
            embeds[row, max_len - request.prompt_len :] = row_embeds.to(embeds.device, embeds.dtype)
        return {"inputs_embeds": embeds, "attention_mask": mask}


class RowSampler(LogitsProcessor):
    """Per-row sampling inside one ``generate()`` call: scores [B, V] -> one-hot rows of the picks."""

    def __init__(self, jobs: Sequence[ReferenceRequest], device: torch.device):
        self._jobs = jobs
        self._sampler = Sampler()
        self._states = [SamplingState.for_params(j.params, device, j.index) for j in jobs]
        matchers = [GrammarMatcher(j.params.grammar) if j.params.grammar is not None else None for j in jobs]
        self._matchers = matchers if any(m is not None for m in matchers) else []
        self._generated: list[list[int]] = [[] for _ in jobs]
        self._first = True
        self.step_logprobs: list[TokenLogprob | None] | None = None  # this step's, per row (read by StepReporter)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self._first:  # the previous step's picks are now the last column of input_ids
            for row, token in enumerate(input_ids[:, -1].tolist()):
                self._generated[row].append(token)
        self._first = False
        seen = [
            (j.prompt_token_ids or []) + gen if j.params.needs_penalty else None
            for j, gen in zip(self._jobs, self._generated)
        ]
        token_mask = step_mask(self._matchers, scores.shape[-1]) if self._matchers else None
        sampled = self._sampler(scores, SamplerBatch([j.params for j in self._jobs], self._states, seen,
                                                   token_mask))
        if token_mask is not None:
            advance(self._matchers, sampled.token_ids.tolist())
        self.step_logprobs = sampled.logprobs
        one_hot = torch.full_like(scores, float("-inf"))
        one_hot.scatter_(1, sampled.token_ids.view(-1, 1), 0.0)
        return cast(torch.FloatTensor, one_hot)  # (the type transformers' LogitsProcessor declares)


class StepReporter(StoppingCriteria):
    """Per-row stop decisions and step reports; returns [B] bools (True: this row is done)."""

    def __init__(self, jobs: Sequence[ReferenceRequest], eos: frozenset[int], on_step: OnOutputs,
                 row_sampler: RowSampler | None = None):
        self._jobs = jobs
        self._eos = eos
        self._on_step = on_step
        self._row_sampler = row_sampler
        self._num_generated = [0] * len(jobs)
        self._done = [False] * len(jobs)
        self._aborted: set[tuple[str, int | None]] = set()  # (request id, index or None for every row)

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Mark the request's rows (or row ``index``) of this batch aborted; False when it is not in the batch."""
        if not any(j.request_id == request_id for j in self._jobs):
            return False
        self._aborted.add((request_id, index))
        return True

    def _is_aborted(self, job: ReferenceRequest) -> bool:
        return (job.request_id, None) in self._aborted or (job.request_id, job.index) in self._aborted

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        new_tokens = input_ids[:, -1].tolist()
        step_logprobs = self._row_sampler.step_logprobs if self._row_sampler is not None else None
        outputs = []
        for row, job in enumerate(self._jobs):
            if self._done[row]:
                continue
            if self._is_aborted(job):
                self._done[row] = True
                outputs.append(RequestOutput(job.request_id, [], True, FinishReason.ABORT, job.index))
                continue
            token = new_tokens[row]
            self._num_generated[row] += 1
            reason = None
            if token in self._eos and not job.params.ignore_eos:
                reason = FinishReason.STOP
            elif self._num_generated[row] >= job.params.max_new_tokens:
                reason = FinishReason.LENGTH
            self._done[row] = reason is not None
            logprob = step_logprobs[row] if step_logprobs is not None else None
            outputs.append(RequestOutput(job.request_id, [token], reason is not None, reason, job.index,
                                         (logprob,) if logprob is not None else None))
        if outputs:
            self._on_step(outputs)
        # Aborts requested inside on_step take effect now, not one step later.
        for row, job in enumerate(self._jobs):
            if not self._done[row] and self._is_aborted(job):
                self._done[row] = True
                self._on_step([RequestOutput(job.request_id, [], True, FinishReason.ABORT, job.index)])
        # (the type transformers' StoppingCriteria declares)
        return cast(torch.BoolTensor, torch.tensor(self._done, dtype=torch.bool, device=input_ids.device))

    def finish_remaining(self) -> None:
        """Rows still open when generate() returned (it stopped at its own length limit)."""
        rest = [RequestOutput(j.request_id, [], True, FinishReason.LENGTH, j.index) for row, j in enumerate(self._jobs)
                if not self._done[row]]
        if rest:
            self._on_step(rest)
