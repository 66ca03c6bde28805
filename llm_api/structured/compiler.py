"""Compiling grammar specs for one tokenizer, and the cache of what was compiled.

Contract
- ``GrammarCompiler(tokenizer, vocab_size, stop_token_ids)`` is built once per model. ``compile(spec)``
  checks the spec against the compile-cost limits first (``llm_api.structured.spec.check_limits``), is
  thread-safe and meant for a worker pool, never the engine thread (xgrammar releases the GIL while
  compiling). Most schemas take ~50 ms of CPU, but each distinct string length bound costs ~20 ms per
  character up to ~4 s (``maxLength: 80``: ~2 s; six fields with ``maxLength: 300``: ~27 s), and it
  cannot be interrupted: bound the pool and the queue in front of it (``llm_api.service.grammars``).
  Results sit in a bounded LRU (entries and bytes); threads asking for the same spec at once share one
  compilation. A spec the library rejects raises ``GrammarError`` with a one-line message (echoed input
  cut to ~200 chars); so does one whose language is empty (it would allow no first token at all).
- ``CompiledGrammar`` is read-only and shared by every matcher of its spec (``llm_api.structured.matcher``).
- Never allowed inside a grammar: the tokenizer's special tokens (xgrammar alone would take
  ``<|endoftext|>`` for the literal text and let it into a JSON string, where the detokenizer then drops
  it), and the padding ids of an lm_head wider than the tokenizer (``vocab_size > len(tokenizer)``).
  Stop tokens are allowed only where the grammar may end.
- xgrammar is imported on first use (``llm_api.structured.library``): building a compiler without it
  raises ImportError naming the pip line.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Iterable

from llm_api.structured.bitmask import allocate_bitmask
from llm_api.structured.library import load_xgrammar
from llm_api.structured.spec import (JSON_MAX_WHITESPACE, GrammarError, GrammarLimits, GrammarSpec, check_limits,
                                     kind_name, one_line)

__all__ = ["GrammarCompiler", "CompiledGrammar", "GrammarCacheInfo", "special_token_ids"]

# "[11:33:45] /project/cpp/regex_converter.cc:83: " and "Check failed: (...) is false: " in xgrammar errors.
_LOG_PREFIX = re.compile(r"^\s*\[[0-9:.]+\]\s+\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"Check failed: \(.*?\) is false:\s*")


def _library_message(error: BaseException) -> str:
    message = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", str(error)))
    # xgrammar echoes the whole schema after a JSON syntax error: the position before it is enough.
    message = message.split("The JSON string is:")[0]
    return one_line(message) or type(error).__name__


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled for one tokenizer; shared by every matcher of that spec (read-only)."""

    spec: GrammarSpec
    compile_seconds: float  # wall time of the one compilation (cache hits return this same object)
    memory_bytes: int
    _compiled: Any = field(repr=False)  # xgrammar.CompiledGrammar


@dataclass(frozen=True)
class GrammarCacheInfo:
    hits: int
    misses: int  # compilations started (failed ones included)
    num_entries: int
    num_bytes: int
    compile_seconds_total: float


def special_token_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens (bos/eos/pad... and added tokens flagged special)."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ()}
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


class GrammarCompiler:
    """Compiles specs for one tokenizer and logits width; thread-safe; caches by spec.

    vocab_size: the model's logits width (may exceed len(tokenizer): the extra ids are never allowed).
    stop_token_ids: the ids that end a sequence (the engine's EOS set); default the tokenizer's EOS.
    json_any_whitespace / json_max_whitespace: whitespace a JSON grammar allows between elements.
      Default: any JSON whitespace (models trained on pretty-printed JSON keep their layout), at most
      ``json_max_whitespace`` characters in a row, so a small model cannot loop on newlines until
      max_new_tokens. ``json_any_whitespace=False``: one fixed layout (``, `` and ``: ``).
    num_threads: xgrammar's threads per compilation (default half the cores, 1 to 8: compilation shares
      the machine with the engine thread).
    limits: the compile-cost limits every spec is checked against before compiling (``check_limits``).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int] | None = None, *,
                 max_cached: int = 64, max_cached_bytes: int = 256 << 20,
                 json_any_whitespace: bool = True, json_max_whitespace: int | None = JSON_MAX_WHITESPACE,
                 num_threads: int | None = None, limits: GrammarLimits = GrammarLimits()):
        xgr = load_xgrammar()
        self.limits = limits
        if stop_token_ids is None:
            if getattr(tokenizer, "eos_token_id", None) is None:
                raise ValueError("the tokenizer has no eos_token_id: pass stop_token_ids")
            stop_token_ids = [tokenizer.eos_token_id]
        self.stop_token_ids = tuple(sorted({int(t) for t in stop_token_ids}))
        if not self.stop_token_ids or not all(0 <= t < vocab_size for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-empty ids in [0, {vocab_size}), "
                             f"got {list(self.stop_token_ids)}")
        if json_max_whitespace is not None and json_max_whitespace < 1:
            raise ValueError(f"json_max_whitespace must be None or >= 1, got {json_max_whitespace}")
        self.vocab_size = int(vocab_size)
        self.max_cached = max_cached
        self.max_cached_bytes = max_cached_bytes
        self._json_options = dict(any_whitespace=json_any_whitespace, strict_mode=True,
                                  max_whitespace_cnt=json_max_whitespace if json_any_whitespace else None)
        if num_threads is None:
            num_threads = max(1, min(8, (os.cpu_count() or 2) // 2))

        # xgrammar detects the vocabulary's encoding; we then rebuild its token table from the decoded
        # bytes with special tokens blanked (xgrammar's mark for "never inside a grammar"). Stop tokens
        # are matched by id, so they stay allowed where the grammar may end.
        # (xgrammar reads transformers' tokenizer: ours builds one over the same vocabulary for it)
        as_transformers = getattr(tokenizer, "as_transformers", None)
        detected = xgr.TokenizerInfo.from_huggingface(as_transformers() if as_transformers else tokenizer,
                                                      vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.stop_token_ids))
        special = special_token_ids(tokenizer)
        decoded = [b"" if i in special else token for i, token in enumerate(detected.decoded_vocab)]
        self.tokenizer_info = xgr.TokenizerInfo(
            decoded, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids),
            add_prefix_space=detected.add_prefix_space)
        # Our LRU is the cache (bounded, one object per spec); xgrammar's own one is unbounded by default.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=num_threads, cache_enabled=False)

        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0
        self._in_flight: dict[GrammarSpec, Future] = {}
        self._hits = self._misses = 0
        self._compile_seconds_total = 0.0

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        """The compiled grammar of ``spec`` when it is in the cache (a hit), else None; never compiles,
        so it may run on an event loop."""
        with self._lock:
            return self._cache_hit(spec)

    def _cache_hit(self, spec: GrammarSpec) -> CompiledGrammar | None:
        # (the caller holds self._lock) a hit is counted and becomes the most recently used entry
        compiled = self._cache.get(spec)
        if compiled is not None:
            self._cache.move_to_end(spec)
            self._hits += 1
        return compiled

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        if not isinstance(spec, GrammarSpec):
            raise TypeError(f"compile() takes a GrammarSpec, got {type(spec).__name__}")
        check_limits(spec, self.limits)
        with self._lock:
            compiled = self._cache_hit(spec)
            if compiled is not None:
                return compiled
            future = self._in_flight.get(spec)
            owner = future is None
            if future is None:
                future = self._in_flight[spec] = Future()
                self._misses += 1
            else:
                self._hits += 1
        if not owner:
            return future.result()  # the same CompiledGrammar, or the same GrammarError
        try:
            compiled = self._compile(spec)
        except BaseException as e:
            with self._lock:
                del self._in_flight[spec]
            future.set_exception(e)
            raise
        with self._lock:
            del self._in_flight[spec]
            self._insert(spec, compiled)
        future.set_result(compiled)
        return compiled

    def cache_info(self) -> GrammarCacheInfo:
        with self._lock:
            return GrammarCacheInfo(self._hits, self._misses, len(self._cache), self._cached_bytes,
                                    self._compile_seconds_total)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._cached_bytes = 0

    def _insert(self, spec: GrammarSpec, compiled: CompiledGrammar) -> None:
        # Called with the lock held. The newest entry always stays, even when larger than the budget.
        self._cache[spec] = compiled
        self._cached_bytes += compiled.memory_bytes
        while len(self._cache) > 1 and (len(self._cache) > self.max_cached
                                        or self._cached_bytes > self.max_cached_bytes):
            _, evicted = self._cache.popitem(last=False)
            self._cached_bytes -= evicted.memory_bytes

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            if spec.kind == "json_schema":
                try:
                    json.loads(spec.source)
                except ValueError as e:
                    raise GrammarError(f"invalid JSON schema: not valid JSON: {one_line(str(e))}") from None
                compiled = self._compiler.compile_json_schema(spec.source, **self._json_options)
            elif spec.kind == "json_object":
                compiled = self._compiler.compile_json_schema('{"type":"object"}', **self._json_options)
            elif spec.kind == "regex":
                compiled = self._compiler.compile_regex(spec.source)
            elif spec.kind == "structural_tag":
                compiled = self._compiler.compile_structural_tag(spec.source)
            else:
                compiled = self._compiler.compile_grammar(spec.source, root_rule_name="root")
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"invalid {kind_name(spec.kind)}: {_library_message(e)}") from None
        result = CompiledGrammar(spec, time.perf_counter() - start,
                                 int(compiled.memory_size_bytes), compiled)
        self._check_can_start(result)
        seconds = time.perf_counter() - start
        with self._lock:
            self._compile_seconds_total += seconds
        return result

    def _check_can_start(self, compiled: CompiledGrammar) -> None:
        """Refuse a grammar whose language is empty (a ``$ref`` to itself, a cycle of references with no
        way out): it allows no first token, not even a stop token, so a sequence under it could never
        move (a sampled row would have no probability mass at all). One bitmask fill, ~1 ms."""
        bitmask = allocate_bitmask(1, self.vocab_size)
        # A fresh xgrammar matcher, not our GrammarMatcher (llm_api.structured.matcher builds on this module).
        needs_mask = load_xgrammar().GrammarMatcher(compiled._compiled).fill_next_token_bitmask(bitmask, 0)
        if needs_mask and not bool(bitmask.any()):
            raise GrammarError(f"the {kind_name(compiled.spec.kind)} accepts no output at all (an empty language, "
                               "such as a $ref to itself)")
