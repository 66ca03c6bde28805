"""Verification of drafts: which draft tokens the target model accepts, and the token after them.

``verify(logits, requests, drafts, batch, matchers, stop_token_ids)`` takes, for each drafted request, the
1 + k logits rows of its verification forward (row i: the target distribution after the draft's first i
tokens) and returns the tokens to append: the accepted draft prefix plus one more token (the correction
where a draft token was rejected, the bonus token after a fully accepted draft), and their logprobs.

Rules, per row i while the draft is being accepted:

* every logits processor sees the state it would see without speculation at that position: the row
  goes through ``Sampler.transform`` (logit bias, penalties with the output counts and seen ids of the
  tokens accepted so far, the grammar mask of a matcher that has accepted exactly those tokens: asked
  here, ``structured.matcher.step_mask``, temperature / top-k / top-p), and the token picked goes through
  ``Sampler.commit`` (output counts, logprobs) and into the row's matcher (``structured.matcher.advance``,
  here: the sampler never advances a matcher) before row i + 1 is transformed. A rejected draft token is
  never fed to a matcher or a count, so nothing needs rolling back;
* greedy: the pick is the argmax; the draft token is accepted iff it is that argmax;
* sampled: the draft is a point mass q = 1 at token d, so standard speculative rejection sampling
  accepts d with probability min(1, p(d) / q(d)) = p(d) (one uniform draw from the sequence's generator)
  and on rejection draws from the residual max(0, p - q), i.e. p with d zeroed and renormalized; the
  token after a fully accepted draft is drawn from p. The result has exactly the distribution p at every
  position (tests/engine/test_speculative.py checks it statistically, and checks that a wrong rule fails);
* an accepted stop token (EOS, unless ``ignore_eos``) ends the list: nothing after it is appended.

Cost: when every drafted row is a plain argmax (greedy, no bias / penalties / grammar / logprobs) it is
one argmax over all rows and a compare of short lists on the host. Otherwise rows are processed one draft
position at a time (batched across requests), at most k + 1 sampler passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from llm_api.engine.request import Request, TokenLogprob
from llm_api.engine.sampler import Sampler, SamplerBatch
from llm_api.structured.matcher import GrammarMatcher, advance, live_rows, step_mask


@dataclass
class Verified:
    token_ids: list[int]  # accepted draft tokens, then one more (or ending at an accepted stop token)
    logprobs: list[TokenLogprob] | None  # one per token, when the request asked for logprobs


def split_drafted_rows(logits: torch.Tensor, requests: list[Request], drafts: Mapping[str, list[int]]):
    """The model runner's rows (1 + k consecutive rows for a drafted request, one otherwise) ->
    (plain rows, their requests, drafted rows, their requests)."""
    plain_rows: list[int] = []
    drafted_rows: list[int] = []
    plain_requests, drafted_requests = [], []
    row = 0
    for request in requests:
        draft = drafts.get(request.seq_id)
        if draft:
            drafted_rows.extend(range(row, row + 1 + len(draft)))
            drafted_requests.append(request)
            row += 1 + len(draft)
        else:
            plain_rows.append(row)
            plain_requests.append(request)
            row += 1

    def select(rows: list[int]) -> torch.Tensor:
        if len(rows) == logits.shape[0]:
            return logits
        return logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))

    return select(plain_rows), plain_requests, select(drafted_rows), drafted_requests


def verify(logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[list[int]], batch: SamplerBatch,
           matchers: Sequence[GrammarMatcher | None], stop_token_ids: frozenset[int]) -> list[Verified]:
    """``logits``: [sum of (1 + len(draft)), V], each request's rows in order; ``batch`` and ``matchers`` (each
    request's grammar matcher, None without one): one row per request."""
    params = batch.params
    if not live_rows(matchers) and all(p.argmax_only for p in params):
        return _verify_argmax(logits, requests, drafts, stop_token_ids)
    offsets = []
    row = 0
    for draft in drafts:
        offsets.append(row)
        row += 1 + len(draft)
    tokens: list[list[int]] = [[] for _ in requests]
    logprobs: list[list[TokenLogprob] | None] = [[] if p.logprobs is not None else None for p in params]
    alive = list(range(len(requests)))
    position = 0
    while alive:
        index = torch.tensor([offsets[j] + position for j in alive], dtype=torch.long, device=logits.device)
        rows = logits.index_select(0, index)
        step_matchers = [matchers[j] for j in alive]
        token_mask = step_mask(step_matchers, rows.shape[-1])
        step_batch = SamplerBatch(
            [params[j] for j in alive], [batch.states[j] for j in alive],
            [_seen(batch, j, tokens[j]) for j in alive], token_mask,
        )
        transformed, greedy_ids, sampling_rows = Sampler.transform(rows, step_batch)
        token_ids = greedy_ids if greedy_ids is not None else torch.empty(len(alive), dtype=torch.long,
                                                                          device=logits.device)
        if sampling_rows:
            probs = transformed[sampling_rows].softmax(dim=-1)
            for i, r in enumerate(sampling_rows):
                draft = drafts[alive[r]]
                token_ids[r] = _draw(probs[i], transformed[r], draft[position] if position < len(draft) else None,
                                     step_batch.states[r].generator)
        out = Sampler.commit(transformed, token_ids, step_batch)
        picked = token_ids.tolist()
        if token_mask is not None:
            advance(step_matchers, picked)
        still = []
        for r, j in enumerate(alive):
            token = picked[r]
            tokens[j].append(token)
            row_logprob = out.logprobs[r] if out.logprobs is not None else None
            if row_logprob is not None:
                lp = logprobs[j]
                assert lp is not None  # (the row asked for logprobs)
                lp.append(row_logprob)
            draft = drafts[j]
            if position < len(draft) and token == draft[position] and not _stops(token, params[j], stop_token_ids):
                still.append(j)
        alive = still
        position += 1
    return [Verified(t, lp) for t, lp in zip(tokens, logprobs)]


def _verify_argmax(logits, requests, drafts, stop_token_ids) -> list[Verified]:
    if logits.dtype == torch.bfloat16 and logits.device.type == "cpu":
        logits = logits.float()  # (faster than a bfloat16 argmax on CPUs without bf16 instructions)
    ids = logits.argmax(dim=-1).tolist()
    results = []
    row = 0
    for request, draft in zip(requests, drafts):
        tokens = []
        for i in range(len(draft) + 1):
            token = ids[row + i]
            tokens.append(token)
            if i == len(draft) or token != draft[i] or _stops(token, request.params, stop_token_ids):
                break
        results.append(Verified(tokens, None))
        row += 1 + len(draft)
    return results


def _draw(probs: torch.Tensor, transformed: torch.Tensor, draft_token: int | None,
          generator: torch.Generator | None) -> int:
    """One sampled position: accept ``draft_token`` with probability p(d), else draw from the residual."""
    if torch.isnan(probs[0]):  # no allowed token at all: the argmax, as the sampler does (see there)
        return int(transformed.argmax())
    if draft_token is None:
        return int(torch.multinomial(probs, 1, generator=generator)[0])
    p_draft = probs[draft_token]
    if torch.rand((), generator=generator, device=probs.device) < p_draft:
        return draft_token
    residual = probs.clone()
    residual[draft_token] = 0.0
    if not bool(residual.sum() > 0):  # p(d) rounds to 1: the residual is empty (d was all but certain)
        return draft_token
    return int(torch.multinomial(residual, 1, generator=generator)[0])  # (multinomial normalizes)


def _seen(batch: SamplerBatch, row: int, accepted: list[int]):
    seen = batch.seen_token_ids[row] if batch.seen_token_ids else None
    if seen is None:
        return None
    return list(seen) + accepted if accepted else seen


def _stops(token: int, params, stop_token_ids: frozenset[int]) -> bool:
    return token in stop_token_ids and not params.ignore_eos
