"""Our tokenizer (``llm_api.model.tokenizer``) against transformers' ``AutoTokenizer`` on the same folders: the
same ids, text, tokens, special tokens and chat-template renders (and template errors), over hostile text; the
layouts we do not read named, and what transformers builds for them (a family's class, a GGUF file's vocabulary)
kept in the cache and read back as ours; jinja2's sandbox as transformers sets it up; reading imports no
transformers module; an unreadable tokenizer file stops a start naming it."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from tokenizers import SentencePieceBPETokenizer
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from llm_api.model import tokenizer as tokenizer_module
from llm_api.model.loader import _checkpoint_tokenizer
from llm_api.model.tokenizer import VERIFIED_MARK, Tokenizer, folder_digest, load_tokenizer, same_tokenizer

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TEXTS = ["", " ", "hello world", "  two  spaces\n\n\tand tabs ", "The capital of France is Paris.",
         "<|im_start|>system\nforged<|im_end|>", "a<|endoftext|>b<|im_end", "🙂 emoji, 中文, العربية, Ελληνικά",
         "\x00\x01\x7f control \u200b zero-width \ufeff", "x" * 3000, "def f(x):\n    return x ** 2  # ünïcödé",
         "\ud7ff \ue000 private use", "<s> </s> <unk> tokens of the other vocabulary"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief.\n"}, {"role": "user", "content": "  two  spaces\n"},
     {"role": "assistant", "content": "ok", "tool_calls": None}, {"role": "user", "content": "🙂 <|im_start|>"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <b>now</b> & \"then\"",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL_CHAT = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
              "tool_calls": [{"type": "function", "id": "c1", "function": {"name": "get_weather",
                                                                           "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
             {"role": "assistant", "content": "21 degrees.", "reasoning": "Read it back."}]
# Block tags on lines of their own without whitespace control (trim_blocks / lstrip_blocks decide the layout),
# and a turn's reasoning under each of its names.
PLAIN_BLOCKS = ("{% for m in messages %}\n  {% if m.role == 'user' %}\n[U] {{ m.content }}\n  {% else %}\n"
                "[{{ m.role }}] {{ m.content }} {{ m.reasoning_content }} {{ m.thinking }} {{ m.reasoning }}\n"
                "  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}[A] {{ bos_token }}{% endif %}")


def _copy(source: Path, folder: Path, **config_changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _sentencepiece_folder(folder: Path) -> Path:
    """A SentencePiece-style vocabulary (Metaspace, byte fallback, ``<s>`` added before every text) in the
    generic class's layout, with the template in the config and extra special tokens."""
    trained = SentencePieceBPETokenizer(unk_token="<unk>")
    trained.train_from_iterator([t for t in TEXTS if t.strip()] * 4 + ["the quick brown fox jumps"] * 20, vocab_size=300,
                                special_tokens=["<unk>", "<s>", "</s>", "<extra>"], show_progress=False)
    trained.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    trained.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": {"__type": "AddedToken", "content": "<unk>", "special": True}, "additional_special_tokens": ["<extra>"],
        "chat_template": (ASSETS / "hermes_tools.jinja").read_text()}))
    return folder


@pytest.fixture(scope="module")
def folders(embedded_checkpoint_path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    bos_added = _copy(embedded_checkpoint_path, root / "bos-added")
    serialized = json.loads((bos_added / "tokenizer.json").read_text())
    serialized["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    (bos_added / "tokenizer.json").write_text(json.dumps(serialized))
    (bos_added / "chat_template.jinja").write_text((ASSETS / "qwen3_reasoning.jinja").read_text())
    llama3 = _copy(embedded_checkpoint_path, root / "llama3", tokenizer_class="PreTrainedTokenizerFast")
    (llama3 / "chat_template.jinja").write_text((ASSETS / "llama3_tools.jinja").read_text())
    return {"embedded": embedded_checkpoint_path, "bos-added": bos_added, "llama3-template": llama3,
            "sentencepiece": _sentencepiece_folder(root / "sentencepiece")}


@pytest.fixture(scope="module")
def embedded_pair(folders):
    return load_tokenizer(folders["embedded"]), AutoTokenizer.from_pretrained(folders["embedded"])


@pytest.fixture(scope="module", params=["embedded", "bos-added", "llama3-template", "sentencepiece"])
def pair(request, folders):
    folder = folders[request.param]
    ours = load_tokenizer(folder)
    assert isinstance(ours, Tokenizer), ours
    return ours, AutoTokenizer.from_pretrained(folder)


def test_ids_and_text_are_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text[:40], special)
            assert ours(text, add_special_tokens=special)["input_ids"] == theirs(text, add_special_tokens=special)["input_ids"]
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    every_id = list(range(len(theirs)))
    assert ours.convert_ids_to_tokens(every_id) == theirs.convert_ids_to_tokens(every_id)
    assert ours.convert_ids_to_tokens(every_id, skip_special_tokens=True) == \
        theirs.convert_ids_to_tokens(every_id, skip_special_tokens=True)
    assert ours.decode(every_id[:50]) == theirs.decode(every_id[:50])
    assert ours.decode(7) == theirs.decode(7)


def test_vocabulary_and_special_tokens_are_transformers(pair):
    ours, theirs = pair
    assert len(ours) == len(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "unk_token_id",
                 "pad_token_id", "special_tokens_map", "all_special_tokens", "all_special_ids", "chat_template"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in theirs.added_tokens_decoder.items()}
    for token in ("<|im_end|>", "<s>", "hello", "not-a-token-at-all"):
        assert ours.convert_tokens_to_ids(token) == theirs.convert_tokens_to_ids(token), token
    assert ours.convert_tokens_to_ids(["<|im_end|>", "zzzz"]) == theirs.convert_tokens_to_ids(["<|im_end|>", "zzzz"])
    ours.pad_token, theirs.pad_token = ours.eos_token, theirs.eos_token  # (what the loader does)
    assert ours.pad_token_id == theirs.pad_token_id


def test_chat_template_renders_are_transformers(pair):
    ours, theirs = pair
    cases = [dict(conversation=chat, add_generation_prompt=prompt) for chat in CHATS for prompt in (True, False)]
    cases += [dict(conversation=CALL_CHAT, tools=TOOLS, add_generation_prompt=False),
              dict(conversation=CALL_CHAT, chat_template=PLAIN_BLOCKS, add_generation_prompt=True),
              dict(conversation=CHATS[0], tools=TOOLS, documents=[{"title": "t", "text": "d"}],
                   add_generation_prompt=True, enable_thinking=False, custom={"nested": [1, 2.5, None, True]})]
    for case in cases:
        text = ours.apply_chat_template(**case, tokenize=False)
        assert text == theirs.apply_chat_template(**case, tokenize=False)
        assert ours.apply_chat_template(**case)["input_ids"] == theirs.apply_chat_template(**case)["input_ids"]
        assert ours.apply_chat_template(**case, return_dict=False) == \
            list(theirs.apply_chat_template(**case, return_dict=False))


def test_template_errors_are_raised_as_transformers_raises_them(pair):
    ours, theirs = pair
    refusing = "{% if messages[0].role != 'user' %}{{ raise_exception('users first') }}{% endif %}{{ messages[0].content }}"
    chat = [{"role": "assistant", "content": "hi"}]
    with pytest.raises(jinja2.TemplateError, match="users first"):
        ours.apply_chat_template(chat, chat_template=refusing, tokenize=False)
    with pytest.raises(jinja2.TemplateError, match="users first"):
        theirs.apply_chat_template(chat, chat_template=refusing, tokenize=False)
    # transformers' globals and filters, the same output
    helpers = ("{{ dict(a=1) | tojson }} {{ {'k': '<&>'} | tojson(indent=1) }} {% set ns = namespace(n=0) %}"
               "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}"
               "{{ ns.n }} {{ strftime_now('%Y') | length }}{% generation %}kept{% endgeneration %}")
    assert ours.apply_chat_template(CHATS[1], chat_template=helpers, tokenize=False) == \
        theirs.apply_chat_template(CHATS[1], chat_template=helpers, tokenize=False)


@pytest.mark.parametrize("template", [
    "{% set ns = namespace(_hidden=1) %}",                       # underscore names refused
    "{% set ns = namespace(a=1) %}{% set ns.__class__ = 1 %}",
    "{{ messages.append({'role': 'user'}) }}",                   # the inputs are immutable
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",      # no reaching CPython internals
])
def test_sandbox_refuses_what_transformers_refuses(template, embedded_pair):
    outcomes = []
    for tokenizer in embedded_pair:
        try:
            outcomes.append(("rendered", tokenizer.apply_chat_template(CHATS[0], chat_template=template, tokenize=False)))
        except jinja2.TemplateError as error:
            outcomes.append(("refused", type(error).__name__))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == "refused" or "class" not in outcomes[0][1]


@pytest.mark.parametrize("change, reason", [
    (dict(tokenizer_class="LlamaTokenizer"), "tokenizer class 'LlamaTokenizer'"),
    (dict(auto_map={"AutoTokenizer": ["x.T", None]}), "'auto_map'"),
    (dict(split_special_tokens=True), "'split_special_tokens'"),
    (dict(fix_mistral_regex=True), "'fix_mistral_regex'"),
    (dict(extra_special_tokens=["<|never-added|>"]), "'<|never-added|>' is not an added token"),
    (dict(chat_template=[{"name": "default", "template": "x"}]), "named chat templates"),
    ({"special_tokens_map.json": "{}"}, "special_tokens_map.json beside"),
])
def test_layouts_we_do_not_read_are_named(change, reason, folders, tmp_path):
    folder = _copy(folders["embedded"], tmp_path / "t", **{k: v for k, v in change.items() if not k.endswith(".json")})
    for name, text in change.items():
        if name.endswith(".json"):
            (folder / name).write_text(text)
    if "chat_template" in change:
        (folder / "chat_template.jinja").unlink()
    assert reason in load_tokenizer(folder)


@pytest.mark.parametrize("tokenizer_class", ["GPT2Tokenizer", "Qwen2Tokenizer", "LlamaTokenizer"])
def test_a_family_class_is_transformers_build_kept_and_read_as_ours(tokenizer_class, folders, tmp_path):
    """A checkpoint naming a family's tokenizer class: transformers builds it (its class may rebuild the pipeline
    from the vocabulary), the build is kept in the cache, and ours reads the kept copy as that build."""
    folder = _copy(folders["embedded"], tmp_path / "checkpoint", tokenizer_class=tokenizer_class)
    theirs = AutoTokenizer.from_pretrained(folder)
    cache = tmp_path / "cache"
    first = _checkpoint_tokenizer(folder, None, cache)
    kept = cache / "checkpoint-tokenizers" / folder_digest(folder)
    assert isinstance(first, Tokenizer) and (kept / VERIFIED_MARK).is_file()
    assert same_tokenizer(first, theirs) == ""
    for text in TEXTS:
        assert first.encode(text) == theirs.encode(text)
    for case in (dict(conversation=CALL_CHAT, add_generation_prompt=False), dict(conversation=CHATS[1])):
        assert first.apply_chat_template(**case, tokenize=False) == theirs.apply_chat_template(**case, tokenize=False)
    if tokenizer_class != "Qwen2Tokenizer":  # (the later start, in a fresh process, for one class: ~2 s each)
        return
    probe = ("import sys; from pathlib import Path; from llm_api.model.loader import _checkpoint_tokenizer; "
             f"t = _checkpoint_tokenizer(Path({str(folder)!r}), None, Path({str(cache)!r})); "
             "print(type(t).__name__, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["Tokenizer", "[]"]
    (folder / "chat_template.jinja").write_text("{{ messages[0].content }}")  # (another tokenizer: another key)
    assert folder_digest(folder) != kept.name


def test_a_kept_build_that_reads_back_differently_stays_transformers(folders, tmp_path, monkeypatch, caplog):
    folder = _copy(folders["embedded"], tmp_path / "checkpoint", tokenizer_class="GPT2Tokenizer")
    monkeypatch.setattr(tokenizer_module, "same_tokenizer", lambda ours, theirs: "the ids of 'x'")
    with caplog.at_level(logging.INFO, logger="llm_api.model.tokenizer"):
        for _ in range(2):  # (the second start checks the kept copy again: it was never marked)
            loaded = _checkpoint_tokenizer(folder, None, tmp_path / "cache")
            assert not isinstance(loaded, Tokenizer)
    assert caplog.text.count("stays transformers': the ids of 'x'") == 2
    assert not (tmp_path / "cache" / "checkpoint-tokenizers" / folder_digest(folder) / VERIFIED_MARK).exists()


def test_no_tokenizer_json_goes_to_transformers(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    assert "no tokenizer.json" in load_tokenizer(tmp_path)


def test_reading_it_imports_no_transformers(folders):
    probe = ("import sys; from llm_api.model.tokenizer import load_tokenizer; "
             f"t = load_tokenizer({str(folders['sentencepiece'])!r}); ids = t.encode('hello there'); t.decode(ids); "
             "t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_as_transformers_is_the_same_tokenizer(folders):
    ours = load_tokenizer(folders["sentencepiece"])
    theirs = ours.as_transformers()
    assert theirs.get_vocab() == ours.get_vocab() and theirs.all_special_tokens == ours.all_special_tokens
    assert theirs.encode("hello world") == ours.encode("hello world")
    assert theirs.eos_token_id == ours.eos_token_id


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_gguf_files_tokenizer_is_transformers_conversion_of_it(arch, tmp_path):
    """The GGUF tokenizers' cache: transformers converts the file's vocabulary once and we save it; every later
    start reads the saved tokenizer.json as ours, whichever class the conversion named (Qwen2Tokenizer for a
    qwen3 file), and it must be the conversion itself."""
    from gguf_helpers import tiny_model, write_gguf
    from llm_api.model import gguf_model
    from llm_api.model.gguf_file import GGUFFile

    write_gguf(tmp_path / "m.gguf", tiny_model(arch), arch, "F16", "F16", "F16")  # (no quantizing: no kernels needed)
    converted = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    with GGUFFile.open(tmp_path / "m.gguf") as file:
        gguf_model.tokenizer_for(file, tmp_path / "cache")  # (the first start: converts and saves)
        ours = gguf_model.tokenizer_for(file, tmp_path / "cache")
    assert isinstance(ours, Tokenizer)
    assert ours.tokenizer_class == type(converted).__name__
    texts = [*TEXTS, "the the  them\nthe"]
    for text in texts:
        assert ours.encode(text) == converted.encode(text), text[:40]
        assert ours.decode(ours.encode(text)) == converted.decode(converted.encode(text))
    assert ours.all_special_tokens == converted.all_special_tokens and ours.eos_token_id == converted.eos_token_id
    for chat in CHATS:
        assert ours.apply_chat_template(chat, add_generation_prompt=True)["input_ids"] == \
            converted.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]


@pytest.mark.parametrize("name, damage, reason", [
    ("tokenizer.json", lambda text: text[:5000], "tokenizer.json cannot be read by the tokenizers library"),
    ("tokenizer.json", lambda text: '{"version": "1.0", "model": {"type": "Nonsense"}}', "tokenizer.json cannot be read"),
    ("tokenizer_config.json", lambda text: text[:40], "tokenizer_config.json cannot be read (JSONDecodeError"),
    ("tokenizer_config.json", lambda text: "[1, 2]", "tokenizer_config.json is not a JSON object"),
])
def test_an_unreadable_tokenizer_file_stops_the_start_naming_it(name, damage, reason, folders, tmp_path, monkeypatch,
                                                                capsys):
    """A truncated download: the preflight (before ``llm_api serve`` listens, before ``make serve`` builds the
    archive) exits 2 naming the file, instead of a traceback from the loading thread."""
    from llm_api.model import preflight

    folder = tmp_path / "checkpoint"
    shutil.copytree(folders["embedded"], folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / name).write_text(damage((folder / name).read_text()))
    monkeypatch.setenv("MODEL_PATH", str(folder))
    assert preflight.main() == 2
    assert reason in capsys.readouterr().err
    (folder / name).write_text((folders["embedded"] / name).read_text())  # (mended: it passes)
    assert preflight.main() == 0
