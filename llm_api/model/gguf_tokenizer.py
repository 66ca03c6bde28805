"""A GGUF file's tokenizer built from its metadata the way llama.cpp tokenizes that file, without transformers.

A GGUF file carries no tokenizer.json: its vocabulary (``tokenizer.ggml.tokens``, ``.token_type``, ``.scores``,
``.merges``), the kind of model (``tokenizer.ggml.model``), the name of the pre-tokenizer its merges were learned
with (``tokenizer.ggml.pre``) and the special tokens' ids. llama.cpp, the runtime these files are made for, turns
those names into a tokenizer by fixed rules (its src/llama-vocab.cpp), and its tests check the result against
the model's original Hugging Face tokenizer (models/ggml-vocab-*.gguf with their .inp/.out texts and ids).
This module follows the same rules and hands the work to the ``tokenizers`` library (the Rust BPE that the
original tokenizers are), assembling its pipeline:

* ``tokenizer.ggml.model == "llama"`` (SentencePiece BPE: Llama 2, Mistral, TinyLlama files): the BPE of the
  vocabulary with merges ranked by the merged piece's score (SentencePiece's order), byte fallback for what
  the vocabulary lacks (``<0xNN>`` tokens), unknown pieces fused; a "▁" prepended to every stretch of text
  between special tokens and spaces written "▁" (``tokenizer.ggml.add_space_prefix``, true unless the file
  says otherwise), as llama.cpp and the original Llama tokenizer do; a BOS before each prompt unless
  ``tokenizer.ggml.add_bos_token`` is false.
* ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) with a pre-tokenizer named in ``PRE_TOKENIZERS``: the
  file's merges, the text split as the original tokenizer splits it (GPT-2's pattern; StarCoder's and SmolLM's
  digits one by one first; Llama 3's, Qwen2's and DeepSeek Coder's patterns), Llama 3's vocabularies taking a
  whole word that is a token without merging (``ignore_merges``, which llama.cpp sets for those names).

Control tokens (token type 3) and the unknown token (2) are special added tokens, user-defined ones (4) plain
added tokens, both matched whole in the text (as llama.cpp's parse of special tokens does); the named special
tokens (bos/eos/unk/pad) come from the ids in the file and the chat template from ``tokenizer.chat_template``.

``build_tokenizer(file)`` returns our ``Tokenizer`` or, for any other vocabulary (another model kind, a
pre-tokenizer name not in the table, ``remove_extra_whitespaces``, a file without scores or merges), the reason;
the caller then keeps transformers' conversion (``llm_api.model.gguf_model.tokenizer_for``).

Why not transformers' conversion (``AutoTokenizer.from_pretrained(..., gguf_file=...)``) for these: it
tokenizes some files unlike llama.cpp and the original tokenizer (measured against llama.cpp's own vocabulary
tests: a Llama 2 SentencePiece file differs on 14 of 46 texts, every text that starts with a space; a Llama 3
file on one, a word its merges cannot reach), it reads the whole file with gguf-py element by element first
(~7 CPU-s for the embedded model's 49k vocabulary on a 2-core host, once per file), and a transformers release
may change it. Building here takes ~0.2-0.5 s at every start and needs no cache.
"""

from __future__ import annotations

from typing import Any, cast

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from llm_api.model.gguf_file import GGUFFile
from llm_api.model.tokenizer import BYTE_LEVEL_ALPHABET, Tokenizer

# llama.cpp's token types (gguf's TokenType)
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4
SPACE = "\u2581"  # SentencePiece's "▁"

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class _Pre:
    """How a byte-level vocabulary splits text before its merges: ``splits`` applied in order (each match its own
    piece; none: GPT-2's pattern), digits one by one first where ``digits``; ``ignore_merges``: a piece that is a
    token is taken whole; ``add_bos``: a BOS before each prompt where the file does not say (llama.cpp's default
    for the name)."""

    def __init__(self, splits: tuple[str, ...] = (), digits: bool = False, ignore_merges: bool = False,
                 add_bos: bool = False) -> None:
        self.splits, self.digits, self.ignore_merges, self.add_bos = splits, digits, ignore_merges, add_bos

    def pre_tokenizer(self) -> Any:
        steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if self.digits else []
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in self.splits]
        # (GPT-2's own pattern where no other is named: ByteLevel's built-in regex is that pattern)
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not self.splits))
        return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


# tokenizer.ggml.pre -> the split, grouped as llama.cpp's llama-vocab.cpp groups the names (the names it treats
# alike); others keep transformers' conversion.
PRE_TOKENIZERS: dict[str, _Pre] = {
    "gpt-2": _Pre(),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva"),
                    _Pre(digits=True)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
                    _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan"), _Pre((_QWEN2,))),
    "deepseek-coder": _Pre(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
                            r"\p{N}")),
}


def build_tokenizer(file: GGUFFile) -> Tokenizer | str:
    """The file's tokenizer as llama.cpp reads it (the module docstring), or why it is not built here."""
    meta = file.metadata
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    tokens, types = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.token_type")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(token, str) for token in tokens):
        return "no vocabulary (tokenizer.ggml.tokens)"
    if not isinstance(types, list) or len(types) != len(tokens):
        return "no token types (tokenizer.ggml.token_type) for every token"
    if meta.get("tokenizer.ggml.remove_extra_whitespaces"):
        return "tokenizer.ggml.remove_extra_whitespaces"
    if kind == "llama" and not str(meta.get("general.architecture", "")).startswith("gemma"):
        scores = meta.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            return "a SentencePiece vocabulary without a score for every token"
        try:
            backend = _sentencepiece(tokens, types, scores, meta)
        except Exception as error:  # (the tokenizers library refusing the vocabulary)
            return f"the vocabulary does not build ({type(error).__name__}: {str(error)[:200]})"
        add_bos = meta.get("tokenizer.ggml.add_bos_token", True)
    elif kind == "gpt2" and isinstance(pre, str) and pre in PRE_TOKENIZERS:
        merges = meta.get("tokenizer.ggml.merges")
        if not isinstance(merges, list) or not all(isinstance(m, str) and m.count(" ") == 1 for m in merges):
            return "a byte-level vocabulary without merges of two pieces each"
        try:
            backend = _byte_level(tokens, types, merges, PRE_TOKENIZERS[pre])
        except Exception as error:  # (merges naming pieces that are not tokens, ...)
            return f"the vocabulary does not build ({type(error).__name__}: {str(error)[:200]})"
        add_bos = meta.get("tokenizer.ggml.add_bos_token", PRE_TOKENIZERS[pre].add_bos)
    else:
        return f"tokenizer model {kind!r} with pre-tokenizer {pre!r}"
    named = {name: tokens[index] for name, key in (("bos_token", "bos"), ("eos_token", "eos"),
                                                   ("unk_token", "unknown"), ("pad_token", "padding"))
             if isinstance(index := meta.get(f"tokenizer.ggml.{key}_token_id"), int) and 0 <= index < len(tokens)}
    vocabulary = backend.get_vocab()
    _add_tokens(backend, tokens, types, vocabulary)
    unmatched = [token for token in named.values() if backend.token_to_id(token) is None]
    if unmatched:  # (a byte-level vocabulary's special token spelled outside its alphabet)
        return f"special token {unmatched[0][:40]!r} is not a token of the vocabulary as spelled"
    _add_ends(backend, named, bool(add_bos), bool(meta.get("tokenizer.ggml.add_eos_token", False)))
    template = meta.get("tokenizer.chat_template")
    backend.encode_special_tokens = False
    return Tokenizer(backend, named, [], template if isinstance(template, str) else None, "TokenizersBackend")


def _sentencepiece(tokens: list[str], types: list[int], scores: list[float], meta: dict[str, Any]) -> Backend:
    vocab = {token: index for index, token in enumerate(tokens)}
    unknown = next((tokens[i] for i, kind in enumerate(types) if kind == UNKNOWN), None)
    backend = Backend(BPE(vocab=vocab, merges=_merges_by_score(tokens, scores, vocab), unk_token=unknown,
                          fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(SPACE)] if prefix else []) + [normalizers.Replace(" ", SPACE)])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def _merges_by_score(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges: every split of a token into two tokens, ranked by the whole token's score
    (the higher first; for one score, the shorter left piece first, then the vocabulary's order)."""
    ranked = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, len(left), len(right), vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


BYTE_SPELLING = {byte: char for char, byte in BYTE_LEVEL_ALPHABET.items()}  # (how byte-level vocabularies spell bytes)
BYTE_ALPHABET = frozenset(BYTE_LEVEL_ALPHABET)


def _byte_level(tokens: list[str], types: list[int], merges: list[str], pre: _Pre) -> Backend:
    # Control and user-defined tokens are the original tokenizer's added tokens, which llama.cpp's converter writes
    # as their text (``<｜begin▁of▁sentence｜>``) and matches whole: kept as written. Any other token written
    # outside the byte alphabet is respelled in it, as transformers' conversion does.
    vocab = {(token if set(token) <= BYTE_ALPHABET or kind in (CONTROL, USER_DEFINED)
              else "".join(BYTE_SPELLING[b] for b in token.encode())): index
             for index, (token, kind) in enumerate(zip(tokens, types))}
    pairs = [cast(tuple[str, str], tuple(merge.split(" "))) for merge in merges]
    backend = Backend(BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges))
    backend.pre_tokenizer = pre.pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_tokens(backend: Backend, tokens: list[str], types: list[int], vocabulary: dict[str, int]) -> None:
    """Control and unknown tokens as special added tokens, user-defined ones as plain added tokens (each at its
    own id: only tokens of the vocabulary), all matched whole in the text as llama.cpp matches them."""
    special = [AddedToken(token, special=True, normalized=False) for token, kind in zip(tokens, types)
               if kind in (UNKNOWN, CONTROL) and token in vocabulary]
    plain = [AddedToken(token, special=False, normalized=False) for token, kind in zip(tokens, types)
             if kind == USER_DEFINED and token in vocabulary]
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)


def _add_ends(backend: Backend, named: dict[str, str], add_bos: bool, add_eos: bool) -> None:
    """The BOS (and EOS) the file asks to be put around every prompt, as a template processor."""
    ends = [(named[name], backend.token_to_id(named[name])) for name, wanted in
            (("bos_token", add_bos), ("eos_token", add_eos)) if wanted and name in named]
    bos = f"{named['bos_token']} " if add_bos and "bos_token" in named else ""
    eos = f" {named['eos_token']}" if add_eos and "eos_token" in named else ""
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos}$A{eos}", pair=f"{bos}$A{eos} {bos}$B:1{eos}", special_tokens=sorted(set(ends)))

