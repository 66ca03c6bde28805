"""Structured output: grammar specs, their compiled forms, and per-sequence token masks (xgrammar).

Contract
- ``GrammarSpec`` is what a request asks for: a JSON schema, any JSON object, a regex, an EBNF grammar
  or an xgrammar structural tag (free text with tagged JSON sections: tool calls), as text. Specs are
  frozen and hashable; equal specs share one compiled grammar. Build them with the class methods
  (``GrammarSpec.json_schema(dict_or_text)`` writes the canonical text).
- Compile cost is bounded before compiling (``GrammarLimits``, ``check_limits``; the compiler checks
  every spec): the source may hold at most ``max_source_chars`` characters, and the string-length
  bounds (``minLength``/``maxLength``, one count per distinct pair) and repetition bounds (``{m,n}`` in
  a regex, a schema ``pattern`` or an EBNF grammar) may add up to at most ``max_bound_total``. Each unit
  costs ~20 ms of compile on one CPU core (measured: ``maxLength`` 64: 1.4 s, 128: 2.9 s, 300: 4.4 s;
  ten fields with bounds 10..19: 2.2 s), so the default 256 keeps one spec to a few seconds. Brackets
  may nest at most ``max_depth`` (64) levels: compile time grows faster than the depth (measured, one
  core: objects nested 100 deep, 200 JSON levels: 1.2 s; 200 deep: 2.6 s; 400 deep: 16 s, in 22 KB), and
  no real schema comes near 64. A spec over a limit raises ``GrammarError`` naming the limit, at once.
- ``GrammarCompiler(tokenizer, vocab_size, stop_token_ids)`` is built once per model. ``compile(spec)``
  is thread-safe and meant for a worker pool, never the engine thread (xgrammar releases the GIL while
  compiling). Most schemas take ~50 ms of CPU, but each distinct string length bound costs ~20 ms per
  character up to ~4 s (``maxLength: 80``: ~2 s; six fields with ``maxLength: 300``: ~27 s), and it
  cannot be interrupted: bound the pool and the queue in front of it. Results sit in a bounded LRU
  (entries and bytes); threads asking for the same spec at once share one compilation. A spec the
  library rejects raises ``GrammarError`` with a one-line message (echoed input cut to ~200 chars).
- ``GrammarMatcher(compiled)`` follows one sequence; it is not thread-safe (the engine thread owns it).
  Per step: ``fill_bitmask(bitmask, row)`` before sampling, ``accept_token(id)`` after. Once the grammar
  is complete the mask allows the stop tokens (and whatever may still extend the match); accepting a
  stop token terminates the matcher. Stop tokens are never allowed before the grammar can end.
- Token masks are int32 ``[batch, ceil(V / 32)]`` (bit ``t % 32`` of word ``t // 32`` set: token ``t``
  allowed), made by ``allocate_bitmask``. ``apply_bitmask(logits, bitmask, rows)`` sets the disallowed
  logits of the listed rows to -inf in place, row ``r`` of the mask going with row ``r`` of the logits;
  other rows are not read or written, and an empty ``rows`` costs nothing. Apply it after penalties
  and before temperature / top-k / top-p, so that sampling only ever sees allowed tokens.
- Never allowed inside a grammar: the tokenizer's special tokens (xgrammar alone would take
  ``<|endoftext|>`` for the literal text and let it into a JSON string, where the detokenizer then drops
  it), and the padding ids of an lm_head wider than the tokenizer (``vocab_size > len(tokenizer)``).
- xgrammar is imported on first use: importing this module is free and works without xgrammar; building
  a compiler without it raises ImportError naming the pip line.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

__all__ = [
    "GrammarSpec", "GrammarError", "GrammarLimits", "check_limits", "GrammarCompiler", "CompiledGrammar", "GrammarCacheInfo",
    "GrammarMatcher", "allocate_bitmask", "apply_bitmask", "apply_bitmask_reference", "fill_bitmasks",
    "special_token_ids",
]

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")
XGRAMMAR_PIP = "pip install xgrammar==0.2.8"
_MAX_ECHO_CHARS = 200
JSON_MAX_WHITESPACE = 32  # whitespace characters in a row a JSON grammar allows (see GrammarCompiler)
# "[11:33:45] /project/cpp/regex_converter.cc:83: " and "Check failed: (...) is false: " in xgrammar errors.
_LOG_PREFIX = re.compile(r"^\s*\[[0-9:.]+\]\s+\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"Check failed: \(.*?\) is false:\s*")


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(f"structured output needs the xgrammar package: {XGRAMMAR_PIP}") from e
    return xgrammar


class GrammarError(ValueError):
    """A grammar spec the library rejects; the message is one line naming the problem."""


def _one_line(text: str, limit: int = _MAX_ECHO_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _library_message(error: BaseException) -> str:
    message = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", str(error)))
    # xgrammar echoes the whole schema after a JSON syntax error: the position before it is enough.
    message = message.split("The JSON string is:")[0]
    return _one_line(message) or type(error).__name__


@dataclass(frozen=True)
class GrammarSpec:
    """kind: json_object | json_schema | regex | ebnf | structural_tag; source: the schema as canonical
    JSON text, the regex (matched in full), the EBNF (root rule ``root``), or the structural tag as
    canonical JSON text (xgrammar's ``{"type": "structural_tag", "format": ...}``); "" for json_object."""

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, "
                               f"got {_one_line(repr(self.kind), 40)}")
        if not isinstance(self.source, str):
            raise GrammarError(f"grammar source must be a string, got {type(self.source).__name__}")
        if self.kind == "json_object" and self.source:
            raise GrammarError("a json_object grammar takes no source")
        if self.kind != "json_object" and not self.source:
            raise GrammarError(f"a {self.kind} grammar needs a non-empty source")

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> "GrammarSpec":
        """From a schema object or its JSON text, written canonically (compact, keys kept in their
        order: property order is the order the output follows)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"invalid JSON schema: not valid JSON: {_one_line(str(e))}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"invalid JSON schema: must be an object or a boolean, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")))

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, grammar: str) -> "GrammarSpec":
        return cls("ebnf", grammar)

    @classmethod
    def structural_tag(cls, tag: dict) -> "GrammarSpec":
        """From xgrammar's structural tag object (``{"type": "structural_tag", "format": {...}}``)."""
        if not isinstance(tag, dict):
            raise GrammarError(f"a structural tag must be an object, got {type(tag).__name__}")
        return cls("structural_tag", json.dumps(tag, ensure_ascii=False, separators=(",", ":")))


@dataclass(frozen=True)
class GrammarLimits:
    """What one spec may cost to compile (see the module docstring); None: no limit."""

    max_source_chars: int | None = 65536
    max_bound_total: int | None = 256
    max_depth: int | None = 64


# {m}, {m,} or {m,n} in a regex or an EBNF grammar (a literal "{3}" inside quotes counts too: conservative).
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _repetition_total(text: str) -> int:
    total = 0
    for match in _QUANTIFIER.finditer(text):
        low, high = match.group(1), match.group(2)
        # (digits of a huge literal are not converted: anything over 9 digits is over any limit anyway)
        total += min(max(int(low[:10]), int(high[:10]) if high else 0), 10**10)
    return total


def _schema_bound_total(value: Any) -> int:
    """String-length bounds (one count per distinct min/max pair) + repetition bounds of the patterns and
    grammars anywhere in a JSON schema or structural tag. Iterative: the value may be deeply nested."""
    length_pairs: set[tuple[int, int]] = set()
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            low, high = item.get("minLength"), item.get("maxLength")
            bounds = [b for b in (low, high) if isinstance(b, int) and not isinstance(b, bool)]
            if bounds:
                length_pairs.add((low if low in bounds else 0, high if high in bounds else 0))
            for key in ("pattern", "grammar"):
                if isinstance(item.get(key), str):
                    total += _repetition_total(item[key])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total + sum(min(max(abs(low), abs(high)), 10**10) for low, high in length_pairs)


def _nesting_depth(text: str, quoted_strings: bool) -> int:
    """How deep brackets (``{[(``) nest in ``text``, outside escapes and, with ``quoted_strings`` (JSON, EBNF),
    outside double-quoted strings. Counted on the text, so it also works where ``json.loads`` would recurse
    too deep; brackets in a regex character class count too (conservative)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"' and quoted_strings:
            in_string = not in_string
        elif in_string:
            continue
        elif char in "{[(":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "}])":
            depth -= 1
    return deepest


def check_limits(spec: GrammarSpec, limits: GrammarLimits = GrammarLimits()) -> None:
    """Raise ``GrammarError`` when ``spec`` is over a compile-cost limit (cheap: one pass over the source)."""
    if limits.max_source_chars is not None and len(spec.source) > limits.max_source_chars:
        raise GrammarError(f"the {_kind_name(spec.kind)} has {len(spec.source)} characters; the limit is "
                           f"{limits.max_source_chars}")
    if limits.max_depth is not None and spec.kind != "json_object":
        depth = _nesting_depth(spec.source, quoted_strings=spec.kind != "regex")
        if depth > limits.max_depth:
            raise GrammarError(f"the {_kind_name(spec.kind)} nests {depth} levels deep; the limit is "
                               f"{limits.max_depth} (compile time grows faster than the depth)")
    if limits.max_bound_total is None or spec.kind == "json_object":
        return
    if spec.kind in ("json_schema", "structural_tag"):
        try:
            total = _schema_bound_total(json.loads(spec.source))
        except (ValueError, RecursionError):
            return  # not JSON: compile() names that problem
    else:
        total = _repetition_total(spec.source)
    if total > limits.max_bound_total:
        raise GrammarError(f"the {_kind_name(spec.kind)}'s length and repetition bounds (maxLength, minLength, "
                           f"{{m,n}}) add up to {total if total < 10**10 else 'more than 10**10'}; the limit is "
                           f"{limits.max_bound_total} (each unit costs ~20 ms of grammar compile)")


def _kind_name(kind: str) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object grammar", "ebnf": "EBNF grammar",
            "structural_tag": "structural tag"}.get(kind, kind)


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
        xgr = _xgrammar()
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
        detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
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
                    raise GrammarError(f"invalid JSON schema: not valid JSON: {_one_line(str(e))}") from None
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
            raise GrammarError(f"invalid {_kind_name(spec.kind)}: {_library_message(e)}") from None
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
        if GrammarMatcher(compiled).fill_bitmask(bitmask, 0) and not bool(bitmask.any()):
            raise GrammarError(f"the {_kind_name(compiled.spec.kind)} accepts no output at all (an empty language, "
                               "such as a $ref to itself)")


class GrammarMatcher:
    """The grammar state of one sequence. Engine thread only."""

    def __init__(self, grammar: CompiledGrammar):
        self.grammar = grammar
        self._matcher = _xgrammar().GrammarMatcher(grammar._compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write this sequence's allowed next tokens into ``bitmask[row]`` (a CPU int32 tensor from
        ``allocate_bitmask``). Returns False when every token is allowed (the row needs no masking)."""
        if self._matcher.is_terminated():
            raise RuntimeError("the grammar matcher has terminated (a stop token was accepted): no next token")
        return bool(self._matcher.fill_next_token_bitmask(bitmask, row))

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. False (state unchanged) when the grammar does not allow it or
        the matcher has terminated."""
        if self._matcher.is_terminated():
            return False
        return bool(self._matcher.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete match."""
        return bool(self._matcher.is_terminated())

    def is_completed(self) -> bool:
        """True when the tokens so far form a complete match (a stop token would be allowed now)."""
        return bool(self._matcher.is_completed())


def fill_bitmasks(matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """``matchers[i].fill_bitmask(bitmask, rows[i])`` for every i: the one place a step fills its masks.
    A plain loop: xgrammar's threaded ``BatchGrammarMatcher`` was no faster for 8 rows on 2 cores (see
    bench/grammar_overhead.py); a many-core GPU host may want it here."""
    if len(matchers) != len(rows):
        raise ValueError(f"{len(matchers)} matchers for {len(rows)} rows")
    for matcher, row in zip(matchers, rows):
        matcher.fill_bitmask(bitmask, row)


def allocate_bitmask(batch: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """int32 [batch, ceil(vocab_size / 32)] on CPU, every token allowed. ``pin_memory`` for a mask that
    is copied to the GPU every step."""
    return torch.full((batch, math.ceil(vocab_size / 32)), -1, dtype=torch.int32, pin_memory=pin_memory)


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"logits [B, V] and bitmask [B, W] expected, "
                         f"got {tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if bitmask.shape[1] != math.ceil(logits.shape[1] / 32):
        raise ValueError(f"a bitmask for {logits.shape[1]} logits has {math.ceil(logits.shape[1] / 32)} words per row, "
                         f"got {bitmask.shape[1]}")
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    limit = min(logits.shape[0], bitmask.shape[0])
    if min(rows) < 0 or max(rows) >= limit:
        raise ValueError(f"rows must be in [0, {limit}), got {min(rows)}..{max(rows)}")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """In place: ``logits[r, t] = -inf`` for every row r in ``rows`` and token t not allowed by
    ``bitmask[r]``. logits: [B, V] float32/bfloat16/float16 on CPU or CUDA; bitmask: [>= max(rows)+1,
    ceil(V/32)] int32 on CPU (copied to the logits' device when they are on a GPU) or on that device."""
    rows = list(rows)
    if not rows:
        return
    _check(logits, bitmask, rows)
    xgr = _xgrammar()
    if logits.device.type == "cpu":
        if bitmask.device.type != "cpu":
            raise ValueError("CPU logits need a CPU bitmask")
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows, backend="cpu")
        return
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=bitmask.is_pinned())
    backend = "triton" if logits.device.type == "cuda" else "torch_native"
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows, backend=backend)


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """The same as ``apply_bitmask`` in plain torch (the slow reference the tests compare against)."""
    rows = list(rows)
    if not rows:
        return
    _check(logits, bitmask, rows)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    words = bitmask.to(logits.device)[index]  # [R, W]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : logits.shape[1]].bool()  # [R, V]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
