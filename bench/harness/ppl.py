"""llama.cpp's perplexity method (``llama-perplexity``, tools/perplexity/perplexity.cpp, ``perplexity()``), for
scoring any model that gives each prompt token's logprob the same way. Standard library only.

The whole text is tokenized once (with BOS at the start when the vocabulary adds one). ``chunks(tokens,
n_ctx, n_chunks, bos)``: the first ``n_chunks`` runs of ``n_ctx`` tokens (``n_chunks`` < 0: all whole ones
the text holds; at least two must fit, as llama-perplexity demands), each a separate context from position 0,
its first token replaced by ``bos`` when the vocabulary adds one (None: kept). Of each chunk only the second
half is scored: ``scored(token_logprobs, n_ctx)`` keeps the logprobs of positions ``n_ctx // 2 + 1`` to
``n_ctx - 1`` (``n_ctx - n_ctx // 2 - 1`` tokens, each predicted from everything before it in its chunk;
``token_logprobs[j]`` is log p(token j | tokens 0..j-1)). ``estimate(logprobs)``: PPL = exp(mean NLL) over all
scored tokens of all chunks, and the uncertainty llama-perplexity prints after it (``Final estimate: PPL = x
+/- y``: the standard error of the mean NLL times the PPL).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def chunks(tokens: Sequence[int], n_ctx: int, n_chunks: int, bos: int | None = None) -> list[list[int]]:
    if n_ctx < 4:
        raise ValueError(f"a context of {n_ctx} tokens: at least 4")
    if len(tokens) < 2 * n_ctx:
        raise ValueError(f"the text is {len(tokens)} tokens; a context of {n_ctx} needs at least {2 * n_ctx}")
    available = len(tokens) // n_ctx
    count = available if n_chunks < 0 else min(n_chunks, available)
    out = []
    for i in range(count):
        chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def scored(token_logprobs: Sequence[float | None], n_ctx: int) -> list[float]:
    if len(token_logprobs) != n_ctx:
        raise ValueError(f"{len(token_logprobs)} logprobs for a chunk of {n_ctx} tokens")
    kept = token_logprobs[n_ctx // 2 + 1:]
    if any(value is None for value in kept):
        raise ValueError("a scored position has no logprob")
    return [float(value) for value in kept]  # type: ignore[arg-type]


def estimate(logprobs: Sequence[float]) -> tuple[float, float]:
    """(PPL, its +/-) as llama-perplexity computes them from the scored tokens' logprobs."""
    count = len(logprobs)
    if count < 2:
        raise ValueError(f"{count} scored tokens: at least 2")
    nll = -math.fsum(logprobs) / count
    nll2 = math.fsum(value * value for value in logprobs) / count
    ppl = math.exp(nll)
    variance = nll2 - nll * nll
    return ppl, (math.sqrt(variance / (count - 1)) * ppl if variance > 0 else math.nan)
