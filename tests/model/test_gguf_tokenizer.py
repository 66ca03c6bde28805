"""A GGUF file's tokenizer built by us (llm_api.model.gguf_tokenizer) against llama.cpp's own tokenizer tests:
the vocabulary files of llama.cpp's models/ folder and the ids their models' original tokenizers give llama.cpp's
test texts (tests/model/llamacpp_vocab.py), for every rule the module has: SentencePiece (a Llama 2 vocabulary,
and Phi-3's, the same rule), GPT-2's split, StarCoder's (the embedded SmolLM2's), Llama 3's (with whole-word
tokens), Qwen2's and DeepSeek Coder's (whose added tokens are written as text). Each text's ids must equal the
original's, and decode back to the text. The embedded model's tokenizer is ours, the same in its GGUF file and in
the checkpoint made from it. A vocabulary without a rule here is a reason, not a crash (below); served, it is
transformers' conversion, which tests/model/test_tokenizer.py checks on tiny files.

Where transformers' conversion stood on the same files (transformers 5.23.0, 2026-11-29): the Llama 2
vocabulary differed on 14 of its 46 texts (each starting with a space: no "▁" prepended before it), Llama 3's
on one ("Cửa Việt": a word that is a token but that its merges do not reach); and on the embedded model's file
it differed from llama.cpp's own tokenizer (llama-server's /tokenize) on 152 of 1,004 random texts with digits.
"""

from __future__ import annotations

import pytest

from llamacpp_vocab import cases, vocab_files
from llm_api.model.gguf_file import GGUFFile
from llm_api.model.gguf_tokenizer import build_tokenizer
from llm_api.model.tokenizer import Tokenizer

BUILT = ["llama-spm", "phi-3", "gpt-2", "starcoder", "llama-bpe", "qwen2", "deepseek-coder"]


@pytest.fixture(scope="module")
def vocab_folder():
    return vocab_files(BUILT)


def _built(folder, name) -> Tokenizer:
    with GGUFFile.open(folder / f"ggml-vocab-{name}.gguf") as file:
        tokenizer = build_tokenizer(file)
    assert isinstance(tokenizer, Tokenizer), tokenizer
    return tokenizer


@pytest.mark.parametrize("name", BUILT)
def test_ids_are_the_original_tokenizers_on_llama_cpps_texts(name, vocab_folder):
    tokenizer = _built(vocab_folder, name)
    checked = cases(vocab_folder, name)
    assert len(checked) >= 40
    wrong = [(text[:40], want[:10], got[:10]) for text, want in checked
             if (got := tokenizer.encode(text, add_special_tokens=False)) != want]
    assert not wrong, wrong[:5]
    for text, want in checked:
        assert tokenizer.decode(want) == text, text[:40]


def test_special_tokens_bos_and_matched_control_tokens(vocab_folder):
    spm = _built(vocab_folder, "llama-spm")
    assert (spm.bos_token, spm.eos_token, spm.unk_token) == ("<s>", "</s>", "<unk>")
    hello = spm.encode("Hello", add_special_tokens=False)
    assert spm.encode("Hello") == [spm.bos_token_id, *hello]  # (a SentencePiece file adds BOS unless it says not)
    # a control token in the text is that token; the text after it gets its own prefix space, as in llama.cpp
    assert spm.encode("</s>Hello", add_special_tokens=False) == [spm.eos_token_id, *hello]
    llama3 = _built(vocab_folder, "llama-bpe")
    assert llama3.encode("Hi")[0] == llama3.bos_token_id == llama3.convert_tokens_to_ids("<|begin_of_text|>")
    assert llama3.encode("<|eot_id|>", add_special_tokens=False) == [llama3.convert_tokens_to_ids("<|eot_id|>")]
    assert llama3.decode(llama3.encode("a<|eot_id|>b"), skip_special_tokens=True) == "ab"
    deepseek = _built(vocab_folder, "deepseek-coder")  # (its added tokens are written as text, not in bytes)
    assert deepseek.bos_token == "<｜begin▁of▁sentence｜>"
    assert deepseek.encode("x")[0] == deepseek.bos_token_id == 32013
    assert deepseek.encode("<｜end▁of▁sentence｜>", add_special_tokens=False) == [deepseek.eos_token_id]
    qwen = _built(vocab_folder, "qwen2")
    assert qwen.encode("Hi") == qwen.encode("Hi", add_special_tokens=False)  # (the file adds no BOS)


def test_the_embedded_model_splits_digits_as_its_file_says_in_both_forms(embedded_model_path,
                                                                          embedded_checkpoint_path):
    """SmolLM2's vocabulary ('smollm', StarCoder's rule) takes digits one by one and the spaces before them as one
    piece (transformers' conversion: "  5" as "Ġ", "Ġ", "5"; llama.cpp and ours "ĠĠ", "5"); the checkpoint made from
    the file (llm_api.model.embedded) tokenizes as the file does."""
    from transformers import AutoTokenizer

    with GGUFFile.open(embedded_model_path) as file:
        ours = build_tokenizer(file)
    assert isinstance(ours, Tokenizer)
    text = "In 2024, 3 cats ate 12.5 fish"
    digits = ours.convert_ids_to_tokens(ours.encode(" 2024"))
    assert digits == ["Ġ", "2", "0", "2", "4"], digits
    checkpoint = AutoTokenizer.from_pretrained(embedded_checkpoint_path)
    assert ours.convert_ids_to_tokens(ours.encode("  5")) == ["ĠĠ", "5"]
    for sample in (text, " 7 8 9", "x1y22z333", "  5", "x =\n  12;", "\n 5\t"):
        assert checkpoint.encode(sample) == ours.encode(sample), sample


def _vocab_only(path, model: str, pre: str, tokens: list[str], types: list[int], merges=None, scores=None):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges is not None:
        writer.add_token_merges(merges)
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_bos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("model, pre, merges, scores, reason", [
    ("gpt2", "gpt-2", ["a zz"], None, "the vocabulary does not build"),  # (a merge of a piece that is no token)
    ("gpt2", "gpt-2", ["abc"], None, "without merges of two pieces each"),
    ("gpt2", "gpt-2", None, None, "without merges"),
    ("gpt2", "deepseek-llm", ["a b"], None, "pre-tokenizer 'deepseek-llm'"),
    ("llama", "default", None, None, "without a score for every token"),
    ("bert", "default", None, None, "tokenizer model 'bert'"),
])
def test_a_vocabulary_it_cannot_build_is_a_reason_not_a_crash(model, pre, merges, scores, reason, tmp_path):
    tokens = ["<s>", "a", "b", "ab"]
    path = _vocab_only(tmp_path / "v.gguf", model, pre, tokens, [3, 1, 1, 1], merges, scores)
    with GGUFFile.open(path) as file:
        built = build_tokenizer(file)
    assert isinstance(built, str) and reason in built, built
