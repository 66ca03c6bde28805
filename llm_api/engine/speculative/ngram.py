"""N-gram (prompt lookup) proposer: the draft is what followed the last n-gram's most recent earlier match.

``propose(tokens, num_tokens, ngram_min, ngram_max)``: for n from ``ngram_max`` down to
``ngram_min``, take the last n tokens of ``tokens`` and find their most recent earlier
occurrence (one that ends before the last position, so the n-gram does not match itself); the up to
``num_tokens`` tokens that follow it are the draft. The longest n-gram with a match wins: a longer
context makes the continuation likelier to be copied text. No match: an empty draft.

Cost: numpy comparisons over the sequence, n vectorized passes per tried n (``ngram_max`` x length
element compares at worst: ~10 us for 2k tokens), nothing proportional to the vocabulary and no Python
loop over positions. ``TokenBuffer`` keeps each sequence's ids in a numpy array that grows by
appending only the new tokens (amortized doubling), so no step converts the whole list again.

Torch-free (the scheduler calls it).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class TokenBuffer:
    """A sequence's token ids as a growing int64 numpy array (``view()`` is the filled part)."""

    def __init__(self, capacity: int = 256):
        self._data = np.empty(max(16, capacity), dtype=np.int64)
        self.length = 0

    def sync(self, prefix: Sequence[int], tail: Sequence[int]) -> None:
        """Make the buffer hold ``prefix + tail`` (sequences only grow: only the new ids are copied)."""
        total = len(prefix) + len(tail)
        if total < self.length:  # (cannot happen for a live sequence; start over rather than be wrong)
            self.length = 0
        if total > len(self._data):
            grown = np.empty(max(total, 2 * len(self._data)), dtype=np.int64)
            grown[: self.length] = self._data[: self.length]
            self._data = grown
        num_prefix = len(prefix)
        if self.length < num_prefix:
            self._data[self.length : num_prefix] = prefix[self.length :]
            self.length = num_prefix
        start = self.length - num_prefix
        if start < len(tail):
            self._data[self.length : total] = tail[start:]
        self.length = total

    def view(self) -> np.ndarray:
        return self._data[: self.length]


def propose(tokens: np.ndarray, num_tokens: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to ``num_tokens`` draft ids continuing ``tokens`` (1-D int array), or [] when no n-gram matches."""
    length = len(tokens)
    if num_tokens <= 0:
        return []
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        # Candidate starts j in [0, length - n - 1]: the match tokens[j:j+n] ends before the last position.
        num_starts = length - n
        match = tokens[0:num_starts] == tokens[length - n]
        for i in range(1, n):
            match &= tokens[i : num_starts + i] == tokens[length - n + i]
        hits = np.flatnonzero(match)
        if len(hits):
            follow = int(hits[-1]) + n  # the most recent match: the likeliest to be the text being copied
            return tokens[follow : follow + num_tokens].tolist()
    return []
