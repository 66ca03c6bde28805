"""Token ids -> the text a client sees, one delta at a time.

``IncrementalDetokenizer`` turns a request's generated ids into text deltas. With a fast tokenizer it is
``tokenizers``' own ``DecodeStream`` (Rust; about 8x faster than decoding windows from Python, measured
on the embedded model's tokenizer: 2,050 tokens in 12 ms against 106 ms). Otherwise it keeps two
offsets into the ids (the TGI scheme): text is decoded over a short window so tokenizers that merge
spaces across tokens decode correctly. Either way a delta is released only when it does not end in a
partial UTF-8 character, so a multi-byte character split over tokens is never cut in half.

``TextStream`` adds what the edge needs on top: stop strings (the text is cut before the first match
and the request reports it should stop) and a guard that removes the end-of-stream marker from model
output, so the marker appears only once, at the very end of a stream. Both hold back the few characters
that could still turn into a match. Stop strings match the text as the client gets it, the marker taken
out (so no stop string appears in an answer by straddling a marker the model spelled out, and one that
holds the marker among other text never matches); a stop string equal to the marker ends the answer
where the model spelled the marker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None else None
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new token ids; return the text they complete (possibly empty)."""
        if self._stream is not None:
            assert self._backend is not None  # the stream is made only when the tokenizer has a backend
            return "".join(filter(None, (self._stream.step(self._backend, int(t)) for t in token_ids)))
        self._ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            delta = full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back at the end of the request (a dangling partial character)."""
        if self._stream is not None:
            return ""  # DecodeStream holds back only bytes that never completed a character
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""


@dataclass
class StreamDelta:
    """What ``TextStream.push`` releases: text safe to send, and whether a stop matched (the service turns it
    into the request's ``llm_api.service.events.TextDelta``, the one event of that name)."""

    text: str
    stopped: bool  # a stop string matched: the request must stop here


class TextStream:
    """One request's token ids -> safe text deltas, honouring stop strings and the end marker."""

    def __init__(self, tokenizer, stop: Sequence[str], end_marker: str):
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = [s for s in stop if s]
        self._marker = end_marker
        self._pending = ""  # text decoded but held back because it may start a stop or marker
        self._stopped = False
        self.matched_stop: str | None = None  # the stop string that ended the text (Anthropic's stop_sequence)
        self.text = ""  # everything released so far
        self.marker_removed = False  # the model spelled the marker out and it was taken from the answer

    def push(self, token_ids: Sequence[int]) -> StreamDelta:
        if self._stopped:
            return StreamDelta("", True)
        return self._release(self._detok.push(token_ids), final=False)

    def finish(self) -> str:
        """Release what was held back; call once when the request ended for another reason."""
        if self._stopped:
            return ""
        return self._release(self._detok.flush(), final=True).text

    def _release(self, new_text: str, final: bool) -> StreamDelta:
        buf = self._pending + new_text
        # A stop string equal to the marker ends the answer where the model spelled the marker out.
        spelled_end = buf.find(self._marker) if self._marker in self._stop else -1
        if spelled_end >= 0:
            buf = buf[:spelled_end]
        # Stop strings match the text as the client gets it: with the marker taken out, so none can appear
        # in the answer by straddling a marker the model wrote ("a<marker>b" against the stop "ab").
        stripped = _strip_marker(buf, self._marker)
        self.marker_removed = self.marker_removed or len(stripped) != len(buf)
        buf = stripped
        cut, matched = _first_match(buf, self._stop)
        if cut is None and spelled_end >= 0:
            cut, matched = len(buf), self._marker
        if cut is not None:
            self._stopped = True
            self.matched_stop = matched
            out = buf[:cut]
            self._pending = ""
            self.text += out
            return StreamDelta(out, True)
        hold = 0 if final else _held_back(buf, self._stop, self._marker)
        out, self._pending = buf[: len(buf) - hold], buf[len(buf) - hold :]
        self.text += out
        return StreamDelta(out, False)


def _first_match(text: str, stops: Sequence[str]) -> tuple[int | None, str | None]:
    """Where the first stop string in ``text`` starts, and which it is (the first listed of those that
    start there); (None, None) when none is in it."""
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return None, None
    first = min(i for i, _ in hits)
    return first, next(s for i, s in hits if i == first)


def _strip_marker(text: str, marker: str) -> str:
    while marker and marker in text:
        text = text.replace(marker, "")
    return text


def _held_back(text: str, stops: Sequence[str], marker: str) -> int:
    """How many characters at the end of ``text`` to hold: what may still become a stop string or the
    marker, and, before a partial marker (which will vanish if it completes), what may become a stop
    string across it."""
    hold = _longest_partial_suffix(text, [*stops, marker])
    partial_marker = _longest_partial_suffix(text, [marker])
    if partial_marker and stops:
        hold = max(hold, partial_marker + _longest_partial_suffix(text[: len(text) - partial_marker], stops))
    return hold


def _longest_partial_suffix(text: str, patterns: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some pattern."""
    best = 0
    for pattern in patterns:
        for n in range(min(len(pattern) - 1, len(text)), best, -1):
            if text.endswith(pattern[:n]):
                best = n
                break
    return best
