"""Which replica holds a prompt's prefix: the text a request is routed by, and the index of what each
replica has seen (``llm_api.scale_out.router`` decides with it). No Ray here: plain Python, unit-tested alone.

``affinity_text(route, body)``: the part of a request that becomes its prompt's prefix, in prompt order:
for chat, the tools and then each message in turn (JSON, so a conversation continued with one more
message starts with the earlier request's text); for completions and the native route the prompt (or
the messages); for the Responses API the instructions, the tools and the input. Empty when the request
has none (a probe, a tokenizer call, a malformed body: those go to the least-loaded replica).

``PrefixIndex``: per replica, the chained hashes of the leading ``BLOCK_CHARS``-character blocks of the
texts routed to it (block ``i``'s hash covers every character before its end, so a match of ``k`` blocks
is a shared prefix of ``k * BLOCK_CHARS`` characters, like the engine's own block hashes over tokens).
``match(text, replicas)`` -> ``{replica: matched characters}``; ``insert(text, replica)`` after routing;
``forget(replica)`` when one goes away. Each replica's entries are bounded (``max_blocks``, least recently
used out first), as the engine's prefix cache is: the index approximates what the replica's KV pool
still holds, and may be wrong both ways (an evicted prefix looks held; a replica restarted under the
same id looks warm): a wrong guess costs one prefill, never a wrong answer.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Hashable, Iterable

BLOCK_CHARS = 64  # ~16 tokens of English: the granularity of a match
DEFAULT_MAX_BLOCKS = 100_000  # per replica: ~6 MB of prompt text remembered (a few MiB of memory)


def affinity_text(route: str, body: Any) -> str:
    """The text whose prefix decides the replica (the module docstring); ``body``: the parsed JSON body."""
    if not isinstance(body, dict):
        return ""
    parts: list[Any] = []
    if route == "chat":
        parts = [body.get("tools"), *(body.get("messages") or [])] if isinstance(body.get("messages"), list) else []
    elif route == "completions":
        parts = [body.get("prompt")]
    elif route == "generate":
        parts = [body.get("text")] if "text" in body else [body.get("tools"), *(body.get("messages") or [])]
    elif route == "responses":
        parts = [body.get("instructions"), body.get("tools"), body.get("input")]
    return "".join(_text(part) for part in parts if part is not None)


def _text(part: Any) -> str:
    if isinstance(part, str):
        return part
    try:  # (sorted keys: two clients that order a message's fields differently share the prefix)
        return json.dumps(part, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return ""


def block_hashes(text: str) -> list[int]:
    """The chained hashes of ``text``'s whole leading blocks (a trailing partial block is left out)."""
    hashes, previous = [], 0
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        previous = hash((previous, text[start:start + BLOCK_CHARS]))
        hashes.append(previous)
    return hashes


class PrefixIndex:
    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS):
        self.max_blocks = max_blocks
        self._blocks: dict[Hashable, OrderedDict[int, None]] = {}  # replica -> its block hashes, oldest first

    def match(self, text: str, replicas: Iterable[Hashable]) -> dict[Hashable, int]:
        """Characters of ``text``'s prefix each of ``replicas`` holds (0 for a replica not seen)."""
        hashes = block_hashes(text)
        matched = {}
        for replica in replicas:
            held = self._blocks.get(replica)
            count = 0
            if held:
                for value in hashes:  # (from the front: the first block it lacks ends the match)
                    if value not in held:
                        break
                    count += 1
            matched[replica] = count * BLOCK_CHARS
        return matched

    def insert(self, text: str, replica: Hashable) -> None:
        held = self._blocks.setdefault(replica, OrderedDict())
        for value in block_hashes(text):
            held[value] = None
            held.move_to_end(value)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        self._blocks.pop(replica, None)

    def replicas(self) -> list[Hashable]:
        return list(self._blocks)
