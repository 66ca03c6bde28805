"""A model's tokenizer read by us: the ``tokenizers`` serialization (tokenizer.json), the special tokens of
tokenizer_config.json and the chat template (chat_template.jinja, or the config's), without transformers.

Why not transformers' ``AutoTokenizer``: importing it costs a server ~0.8 CPU-s and ~40 MB resident (measured
on the embedded model: 0.74-0.83 s to import, 0.24 s to load against 0.09 s here; 75 MB against 34 MB), it
was the last part of transformers a server of our families imported, and a transformers release that
changes how it builds a tokenizer changes every prompt's ids. The work is still the well-kept libraries':
``tokenizers`` (Rust) encodes and decodes, jinja2's sandbox renders templates; this module holds the thin
layer transformers puts around them, for the one layout it builds nothing else from.

Contract:

- ``load_tokenizer(folder)`` -> a ``Tokenizer``, or the reason (a str) transformers must build this folder's
  instead (``converted_tokenizer`` below). Ours only where AutoTokenizer itself builds nothing but the
  serialization: tokenizer_config.json naming transformers' generic class (``TokenizersBackend``, alias
  ``PreTrainedTokenizerFast``), no remote code, none of the older side files (special_tokens_map.json,
  added_tokens.json, chat_template.json, additional_chat_templates/), one chat template, every special token
  the config names already an added token of tokenizer.json, no truncation or padding in it, no options that
  rewrite it (split_special_tokens, fix_mistral_regex, clean-up of a non-BPE decode). That is the layout
  transformers saves (the embedded checkpoint) and many current Hub models'.
- ``converted_tokenizer(folder, convert)``: what transformers builds otherwise (a GGUF file's vocabulary; a
  checkpoint naming a family's class, keyed by ``folder_digest``), saved once into the cache; the saved
  tokenizer.json is then the whole tokenizer whichever class it names, and once ``same_tokenizer`` finds ours
  equal to transformers' on the probes (ids, text, vocabulary, special tokens, template and a render) the folder
  is marked and every later start reads it as ours.
- ``Tokenizer`` answers the calls the server makes under transformers' names and with its results (``encode``,
  ``__call__``'s ``input_ids``, ``decode``, ``convert_ids_to_tokens`` / ``convert_tokens_to_ids``, the named
  and extra special tokens, ``get_vocab``, ``len``, ``backend_tokenizer``, ``chat_template``,
  ``apply_chat_template``), so code written for either takes both; ``as_transformers()`` builds transformers'
  tokenizer over the same backend for libraries that want one (xgrammar's TokenizerInfo). tests/model/
  test_tokenizer.py holds the two equal.
- Chat templates render in jinja2's immutable sandbox set up as transformers sets up its own (trim_blocks,
  lstrip_blocks, loopcontrols, a ``{% generation %}`` tag that renders its body, ``tojson`` without HTML
  escaping, ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace`` that refuse underscore names),
  with the same variables: the messages with None values dropped and reasoning under its three names,
  ``tools``, ``documents``, ``add_generation_prompt``, the named special tokens, and the caller's extras.
  Everything a template sees is rebuilt from plain JSON types first (anything else becomes ``<TypeName>``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, cast

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
from tokenizers import Tokenizer as Backend

logger = logging.getLogger(__name__)

# The class names under which transformers builds the tokenizer from tokenizer.json alone.
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# The named special tokens, in transformers' order (its SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Side files from which transformers adds to or overrides what tokenizer.json and tokenizer_config.json say.
OTHER_LAYOUT_FILES = ("special_tokens_map.json", "added_tokens.json", "chat_template.json", "additional_chat_templates")
# Config keys that make transformers rebuild or patch the serialization (the value that leaves it as it is).
REWRITING_KEYS = {"auto_map": None, "fast_tokenizer_files": None, "split_special_tokens": False,
                  "fix_mistral_regex": None, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": None,
                  "tokenizer_file": None, "post_processor": None}
# Written beside a tokenizer kept in the cache once ours reads it back as transformers' (``converted_tokenizer``).
VERIFIED_MARK = "llm_api-verified"
# Texts on which a kept tokenizer must give transformers' ids and text (with the special tokens, joined, besides).
PROBES = ("", "Hello, world! The capital of France is Paris.", "  two  spaces\n\n\ttabs and lines ",
          "\U0001f642 \u4e2d\u6587, \u00fcn\u00efc\u00f6d\u00e9, \u0627\u0644\u0639\u0631\u0628\u064a\u0629",
          "def f(x):\n    return x ** 2  # 1234567890", "\x00\x7f \u200b \ufeff <0x0A> <unk> </s> <s>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (what byte-level BPE vocabularies spell bytes with):
    the printable Latin-1 bytes stand for themselves, the other 68 take the characters from U+0100 on, in
    byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {chr(byte): byte for byte in printable}
    table.update({chr(256 + i): byte for i, byte in enumerate(b for b in range(256) if b not in printable)})
    return table


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
# Files of a checkpoint's folder that are weights (not part of its tokenizer's digest).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".index.json")
DIGEST_MAX_BYTES = 256 << 20
# A message's reasoning, under the names templates read it by (the first is the standard one).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def converted_tokenizer(folder: Path, convert: Callable[[], Any]) -> Any:
    """The tokenizer transformers builds (``convert()``: a GGUF file's vocabulary, a checkpoint's family class),
    kept in ``folder``: saved there by the first call, and marked when ours reads the saved copy back as the same
    tokenizer (``same_tokenizer``); read by us on every later call where marked, else by transformers from there."""
    folder = Path(folder)
    if (folder / VERIFIED_MARK).is_file():
        owned = load_tokenizer(folder, saved_whole=True)
        if isinstance(owned, Tokenizer):
            return owned
        logger.info("the tokenizer kept in %s is loaded by transformers: %s", folder, owned)
        return _transformers_from(folder)
    if (folder / "tokenizer_config.json").is_file():  # (kept before the mark existed, or found different: check)
        built = _transformers_from(folder)
    else:
        built = convert()
        try:
            _save(built, folder)
        except OSError as error:  # (a cache we cannot write: transformers' tokenizer, as before the cache)
            logger.info("the tokenizer could not be kept in %s (%s): transformers' is used", folder, error)
            return built
    owned = load_tokenizer(folder, saved_whole=True)
    difference = owned if isinstance(owned, str) else same_tokenizer(owned, built)
    if difference:
        logger.info("the tokenizer kept in %s stays transformers': %s", folder, difference)
        return built
    with contextlib.suppress(OSError):  # (a cache we cannot write: the check runs again next start)
        (folder / VERIFIED_MARK).write_text("read by llm_api.model.tokenizer as transformers' tokenizer\n")
    return owned


def same_tokenizer(ours: Tokenizer, theirs: Any) -> str:
    """Where ours differs from transformers' tokenizer on the probes (ids with and without the special tokens,
    text with and without them, the vocabulary, the special tokens, the template and a render), or ""."""
    texts = [*PROBES, " x ".join(theirs.all_special_tokens)]
    for text in texts:
        for special in (True, False):
            ids = list(theirs.encode(text, add_special_tokens=special))
            if ours.encode(text, add_special_tokens=special) != ids:
                return f"the ids of {text[:30]!r}"
            if any(ours.decode(ids, skip_special_tokens=skip) != theirs.decode(ids, skip_special_tokens=skip)
                   for skip in (True, False)):
                return f"the text of {text[:30]!r}'s ids"
    for name in ("special_tokens_map", "all_special_tokens", "all_special_ids", "bos_token_id", "eos_token_id",
                 "unk_token_id", "pad_token_id", "chat_template"):
        if getattr(ours, name) != getattr(theirs, name, None):
            return f"{name}"
    if len(ours) != len(theirs) or ours.get_vocab() != theirs.get_vocab():
        return "the vocabulary"
    if ours.chat_template:
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROBES[1]}]
        renders = []
        for tokenizer in (ours, theirs):
            try:
                renders.append(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
            except Exception as error:  # (a template that refuses a system turn refuses it in both)
                renders.append(type(error).__name__)
        if renders[0] != renders[1]:
            return "the chat template's render"
    return ""


def _transformers_from(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _save(tokenizer: Any, folder: Path) -> None:
    """transformers' ``save_pretrained`` into ``folder``, atomically (a concurrent start sees a whole folder or
    none) and readable by others sharing the cache."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=folder.parent))
    try:
        tokenizer.save_pretrained(staged)
        for path in [staged, *staged.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)  # (mkdtemp makes 0700)
        if not folder.exists():
            os.replace(staged, folder)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def folder_digest(folder: Path) -> str:
    """A digest of what transformers builds a checkpoint's tokenizer from: every file of the folder but the
    weights (tokenizer files, config.json), the chat templates folder, and transformers' version. A file over
    ``DIGEST_MAX_BYTES`` of another kind counts by its name and size (no tokenizer file is that large)."""
    digest = hashlib.sha256(f"transformers {_transformers_version()}\n".encode())
    paths = [p for p in sorted(Path(folder).iterdir()) if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES)]
    if (Path(folder) / "additional_chat_templates").is_dir():
        paths += sorted((Path(folder) / "additional_chat_templates").iterdir())
    for path in paths:
        size = path.stat().st_size
        digest.update(f"{path.relative_to(folder)} {size}\n".encode())
        if size <= DIGEST_MAX_BYTES:
            digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")  # (the installed version, without importing it)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def check_tokenizer_files(folder: Path) -> None:
    """ValueError naming the file where a checkpoint's tokenizer files cannot be read (tokenizer_config.json not a
    JSON object, tokenizer.json not a serialization ``tokenizers`` reads): what a start can refuse before it
    listens. A folder without them passes (transformers may build the tokenizer from other files)."""
    config_path, serialized = Path(folder) / "tokenizer_config.json", Path(folder) / "tokenizer.json"
    if config_path.is_file():
        _read_config(config_path)
    if serialized.is_file():
        _read_backend(serialized)


def _read_config(path: Path) -> dict:
    """tokenizer_config.json as a dict (ValueError naming the file otherwise)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path.name} cannot be read ({type(error).__name__}: {str(error)[:120]})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return config


def _read_backend(path: Path) -> Backend:
    """tokenizer.json as the ``tokenizers`` library reads it (ValueError naming the file otherwise)."""
    try:
        return Backend.from_file(str(path))
    except Exception as error:  # (tokenizers raises its own Exception type for a file it cannot read)
        raise ValueError(f"{path.name} cannot be read by the tokenizers library ({str(error)[:160]})") from None


def load_tokenizer(folder: Path, saved_whole: bool = False) -> Tokenizer | str:
    """The folder's tokenizer, or why transformers' must load it (see the module docstring). ``saved_whole``:
    tokenizer.json is what transformers built, saved by us (``converted_tokenizer``'s caches), so it is the whole
    tokenizer whichever class the config names (a family's class would rebuild it from its vocabulary and
    merges on every load: the same pipeline, since that class built the one saved)."""
    folder = Path(folder)
    serialized, config_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
    if not serialized.is_file() or not config_path.is_file():
        return "no tokenizer.json beside a tokenizer_config.json"
    try:
        config = _read_config(config_path)
    except ValueError as error:
        return str(error)
    if not isinstance(config.get("tokenizer_class"), str) or (
            config["tokenizer_class"] not in GENERIC_CLASSES and not saved_whole):
        return f"tokenizer class {config.get('tokenizer_class')!r} (transformers' own class builds it)"
    for key, neutral in REWRITING_KEYS.items():
        if config.get(key, neutral) != neutral:
            return f"tokenizer_config.json sets {key!r}"
    for name in OTHER_LAYOUT_FILES:
        if (folder / name).exists():
            return f"{name} beside tokenizer.json"
    named = {name: _content(config.get(name)) for name in NAMED_SPECIAL_TOKENS if config.get(name) is not None}
    extra_value = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
    extra = [_content(token) for token in extra_value] if isinstance(extra_value, list) else [None]
    if None in named.values() or None in extra:
        return "a special token that is neither text nor an added token's fields"
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
    if template is not None and not isinstance(template, str):
        return "named chat templates"
    try:
        backend = _read_backend(serialized)
    except ValueError as error:
        return str(error)
    if backend.truncation is not None or backend.padding is not None:
        return "tokenizer.json sets truncation or padding"
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    declared = [*named.values(), *extra, *(_content(t) for t in (config.get("added_tokens_decoder") or {}).values())]
    missing = [token for token in declared if token not in added]
    if missing:
        return f"special token {str(missing[0])[:40]!r} is not an added token of tokenizer.json"
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return "clean_up_tokenization_spaces on a non-BPE vocabulary"
    backend.encode_special_tokens = False
    return Tokenizer(backend, cast(dict[str, str], named), cast(list[str], extra), template,
                     str(config["tokenizer_class"]))


def _content(token: Any) -> str | None:
    """A special token's text, from a string or the serialized fields of an added token."""
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    return None


class Tokenizer:
    """A ``tokenizers`` backend with its special tokens and chat template (the module docstring has the
    contract). ``pad_token`` and ``padding_side`` are settable, as the loader sets them."""

    def __init__(self, backend: Backend, named: dict[str, str], extra: list[str], chat_template: str | None,
                 tokenizer_class: str) -> None:
        self._backend = backend
        self._named = dict(named)
        self._extra = list(extra)
        self.chat_template = chat_template
        self.tokenizer_class = tokenizer_class  # what transformers calls it (GET /tokenizer_info reports it)
        self.padding_side = "right"

    # -- the vocabulary ----------------------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Backend:
        return self._backend

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return self._backend.get_added_tokens_decoder()

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """A token's id; one outside the vocabulary gets the unknown token's (None without one)."""
        if isinstance(tokens, str):
            found = self._backend.token_to_id(tokens)
            return found if found is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(token) for token in tokens]  # type: ignore[misc]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(i) for i in ids if i not in special]

    # -- special tokens ----------------------------------------------------------------------------

    def _named_token(self, name: str) -> str | None:
        return self._named.get(name)

    def _named_id(self, name: str) -> int | None:
        token = self._named.get(name)
        return None if token is None else self._backend.token_to_id(token)

    bos_token = property(lambda self: self._named_token("bos_token"))
    eos_token = property(lambda self: self._named_token("eos_token"))
    unk_token = property(lambda self: self._named_token("unk_token"))
    bos_token_id = property(lambda self: self._named_id("bos_token"))
    eos_token_id = property(lambda self: self._named_id("eos_token"))
    unk_token_id = property(lambda self: self._named_id("unk_token"))
    pad_token_id = property(lambda self: self._named_id("pad_token"))

    @property
    def pad_token(self) -> str | None:
        return self._named.get("pad_token")

    @pad_token.setter
    def pad_token(self, token: str | None) -> None:
        if token is None:
            self._named.pop("pad_token", None)
        elif self._backend.token_to_id(token) is None:
            raise ValueError(f"pad token {token!r} is not in the vocabulary")
        else:
            self._named["pad_token"] = token

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens (transformers 5's map: the extra ones are not in it)."""
        return {name: self._named[name] for name in NAMED_SPECIAL_TOKENS if name in self._named}

    @property
    def all_special_tokens(self) -> list[str]:
        """Named then extra special tokens, each once."""
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self._extra]))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.convert_tokens_to_ids(token) for token in self.all_special_tokens]  # type: ignore[misc]

    # -- text <-> ids ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """``{"input_ids", "attention_mask"}`` of one text (transformers' call, unbatched and untensored)."""
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat template -----------------------------------------------------------------------------

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, return_dict: bool = True,
                            **kwargs: Any) -> Any:
        """One conversation rendered (transformers' defaults: ``tokenize`` and ``return_dict`` on, so the
        result is ``{"input_ids": ...}``; ``tokenize=False``: the text). Raises ValueError without a template
        or messages, jinja2's TemplateError when the template refuses them."""
        template = chat_template if chat_template is not None else self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("no messages to render")
        if not isinstance(conversation[0], dict):
            raise TypeError("one conversation (a list of message dicts) at a time")
        messages = [{key: value for key, value in message.items() if value is not None} for message in conversation]
        messages = _with_reasoning_aliases(_plain(messages))
        for document in documents or ():
            if not isinstance(document, dict):
                raise TypeError("documents are dicts")
        text = compiled_template(template).render(
            messages=messages, tools=_plain(tools), documents=_plain(documents),
            add_generation_prompt=add_generation_prompt, **_plain({**self.special_tokens_map, **kwargs}))
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    # -- for libraries that take transformers' tokenizer -------------------------------------------

    def as_transformers(self) -> Any:
        """transformers' fast tokenizer over a copy of this backend, with the same special tokens (imports
        transformers: for xgrammar's TokenizerInfo, built once, when structured output is first asked for)."""
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=self._backend, extra_special_tokens=list(self._extra),
                                       chat_template=self.chat_template, **self._named)


def _with_reasoning_aliases(messages: list[dict]) -> list[dict]:
    """A turn's reasoning under all three names (templates read ``reasoning_content``, gpt-oss's ``thinking``)."""
    out = []
    for message in messages:
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


def _plain(value: Any) -> Any:
    """``value`` rebuilt from exact JSON types (a template runs untrusted code in a sandbox that does not know
    which methods of other objects are harmful); anything else becomes the text ``<TypeName>``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, bool, int, float):  # (subclasses: enums, numpy scalars) back to the base type
        if isinstance(value, base):
            return base(value)
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks an assistant's tokens for training masks): the body,
    rendered as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """``dict(...)`` for templates without the type itself (no attribute access to its internals)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` refusing underscore-prefixed names (no reaching CPython internals through it)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # (jinja2's signature trick: ``namespace(self=...)`` works)
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # (jinja2's own tojson escapes HTML characters, which no model was trained on)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compiled_template(source: str) -> jinja2.Template:
    """A chat template compiled once (raises jinja2's TemplateSyntaxError)."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                               namespace=_TemplateNamespace)
    return environment.from_string(source)
