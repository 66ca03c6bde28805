"""Incremental detokenizing: deltas add up to the full decode, UTF-8 is never split, stops cut."""

import pytest

from llm_api.text.detokenizer import IncrementalDetokenizer, TextStream

MARKER = "<|endoftext|>"


@pytest.fixture(scope="module")
def tokenizer(embedded_checkpoint_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_checkpoint_path)


@pytest.mark.parametrize("text", ["Hello world, how are you?", "naïve café — 日本語のテキスト 🙂👍🏽 end", "  spaces\n\nand\ttabs  "])
def test_deltas_concatenate_to_decode(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([i]) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_is_not_split(tokenizer):
    ids = tokenizer("🙂")["input_ids"]
    assert len(ids) > 1  # byte-level BPE spreads the emoji over several tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push([i]) for i in ids][:-1] == [""] * (len(ids) - 1)


def test_stop_string_cuts_text_across_tokens(tokenizer):
    ids = tokenizer("one two three four")["input_ids"]
    stream = TextStream(tokenizer, ["three"], MARKER)
    out, stopped = "", False
    for i in ids:
        delta = stream.push([i])
        out += delta.text
        if delta.stopped:
            stopped = True
            break
    assert stopped and out == "one two "


def test_marker_never_appears_in_model_text(tokenizer):
    ids = tokenizer("a <|endoftext|> b <|endof")["input_ids"]
    stream = TextStream(tokenizer, [], MARKER)
    out = "".join(stream.push([i]).text for i in ids) + stream.finish()
    assert MARKER not in out and out.startswith("a ") and "b" in out


def _spelled(tokenizer, text: str) -> list[int]:
    """Ordinary tokens only: special-token text spelled in pieces, as a model may write it."""
    return [token.id for token in tokenizer.backend_tokenizer.model.tokenize(text)]


def _answer(tokenizer, ids: list[int], stops: list[str]) -> tuple[str, bool]:
    stream = TextStream(tokenizer, stops, MARKER)
    out = ""
    for i in ids:
        delta = stream.push([i])
        out += delta.text
        if delta.stopped:
            return out, True
    return out + stream.finish(), False


@pytest.mark.parametrize("stops, answer, stopped", [
    ([], "xaby", False),
    (["ab"], "x", True),  # matched with the marker taken out: the answer never holds a stop string
    (["y"], "xab", True),
    ([MARKER], "xa", True),  # the marker as a stop string ends the answer where the model spelled it
    ([f"a{MARKER}"], "xaby", False),  # holds the marker among other text: can never match the text
])
def test_stop_strings_match_the_text_without_a_spelled_marker(tokenizer, stops, answer, stopped):
    ids = _spelled(tokenizer, f"xa{MARKER}by")
    assert len(ids) > 4 and 0 not in ids  # the marker spelled in ordinary pieces, not its special token
    assert _answer(tokenizer, ids, stops) == (answer, stopped)


class _SlowTokenizer:
    """The same tokenizer seen without its Rust backend: the detokenizer's offset fallback."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.mark.parametrize("text", ["Hello world, how are you?", "naïve café — 日本語のテキスト 🙂👍🏽 end"])
def test_fallback_without_a_fast_tokenizer_gives_the_same_deltas(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    fast, slow = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(_SlowTokenizer(tokenizer))
    assert slow._stream is None and fast._stream is not None
    fast_deltas = [fast.push([i]) for i in ids] + [fast.flush()]
    slow_deltas = [slow.push([i]) for i in ids] + [slow.flush()]
    assert "".join(slow_deltas) == "".join(fast_deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in slow_deltas)
