"""Grammar masks (llm_api.structured) with the embedded model's tokenizer and random logits.

A driver samples argmax over random logits after the mask, so each step picks a random token the grammar
allows; a bias on the stop tokens ends a sequence as soon as the grammar may end. The output must then
parse and match the grammar, whatever path the random walk took.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import pytest
import torch

xgrammar = pytest.importorskip("xgrammar")

from llm_api.structured.bitmask import allocate_bitmask, apply_bitmask, apply_bitmask_reference  # noqa: E402
from llm_api.structured.compiler import GrammarCompiler  # noqa: E402
from llm_api.structured.matcher import GrammarMatcher, fill_bitmasks  # noqa: E402
from llm_api.structured.spec import GrammarError, GrammarSpec, check_limits  # noqa: E402

VOCAB_SIZE = 49152  # the embedded model's logits width (== len(tokenizer) for SmolLM2)
EOS = 2  # <|im_end|>, the embedded model's EOS

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
}

GREETING_EBNF = r'''
root ::= greeting " " name "!"
greeting ::= "hello" | "hi"
name ::= [A-Z] [a-z]{1,8}
'''


@pytest.fixture(scope="module")
def tokenizer(embedded_checkpoint_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_checkpoint_path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB_SIZE, stop_token_ids=[EOS])


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> set[int]:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:vocab_size].nonzero().flatten().tolist())


def drive(compiler, tokenizer, spec, seed, *, bias=None, max_steps=600, batch=4, row=1):
    """Random-logit walk through the grammar on row ``row`` of a [batch, V] step; the other rows are
    unconstrained and must come out of every apply_bitmask bit-identical. Returns the decoded text."""
    matcher = GrammarMatcher(compiler.compile(spec))
    generator = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(batch, VOCAB_SIZE)
    token_ids = []
    for _ in range(max_steps):
        logits = torch.randn(batch, VOCAB_SIZE, generator=generator)
        if bias is not None:
            logits[row] += bias
        logits[row, EOS] += 30.0  # end as soon as the grammar allows it
        before = logits.clone()
        matcher.fill_bitmask(bitmask, row)
        if EOS in allowed_ids(bitmask, row, VOCAB_SIZE):
            assert matcher.is_completed(), "the stop token was allowed before the grammar could end"
        apply_bitmask(logits, bitmask, [row])
        others = [r for r in range(batch) if r != row]
        assert torch.equal(logits[others], before[others])
        token_id = int(logits[row].argmax())
        assert matcher.accept_token(token_id)
        if matcher.is_terminated():
            assert token_id == EOS
            return tokenizer.decode(token_ids)
        token_ids.append(token_id)
    raise AssertionError(f"no termination in {max_steps} steps: {tokenizer.decode(token_ids)[:200]!r}")


def check_person(value):
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(value, PERSON_SCHEMA)
    assert set(value) == {"name", "age", "color", "tags"}
    assert isinstance(value["name"], str) and 1 <= len(value["name"]) <= 20
    assert type(value["age"]) is int and 0 <= value["age"] <= 150
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 8 for t in value["tags"])


# ----------------------------------------------------------------- generation follows the grammar


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_parses_and_validates(compiler, tokenizer, seed):
    text = drive(compiler, tokenizer, GrammarSpec.json_schema(PERSON_SCHEMA), seed)
    check_person(json.loads(text))


@pytest.mark.parametrize("seed", range(3))
def test_json_object_output_is_an_object(compiler, tokenizer, seed):
    # Favour tokens that close strings, objects and arrays, so the walk ends in a few dozen steps.
    closers = torch.tensor([float(any(c in t for c in '"}]') and not any(c in t for c in "{[,"))
                            for t in tokenizer.convert_ids_to_tokens(list(range(VOCAB_SIZE)))])
    text = drive(compiler, tokenizer, GrammarSpec.json_object(), seed, bias=6.0 * closers)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", range(3))
def test_regex_output_matches(compiler, tokenizer, seed):
    text = drive(compiler, tokenizer, GrammarSpec.regex(r"[0-9]{3}-[a-z]+"), seed)
    assert re.fullmatch(r"[0-9]{3}-[a-z]+", text), text


@pytest.mark.parametrize("seed", range(3))
def test_ebnf_output_matches(compiler, tokenizer, seed):
    text = drive(compiler, tokenizer, GrammarSpec.ebnf(GREETING_EBNF), seed)
    assert re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,8}!", text), text


def test_stop_token_only_at_the_end_and_terminates(compiler):
    matcher = GrammarMatcher(compiler.compile(GrammarSpec.regex(r"ab")))
    bitmask = allocate_bitmask(1, VOCAB_SIZE)
    matcher.fill_bitmask(bitmask, 0)
    assert EOS not in allowed_ids(bitmask, 0, VOCAB_SIZE)
    assert not matcher.accept_token(EOS)
    assert matcher._matcher.accept_string("ab")
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask, 0, VOCAB_SIZE) == {EOS}  # complete and nothing can extend it
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    assert not matcher.accept_token(EOS)
    with pytest.raises(RuntimeError, match="terminated"):
        matcher.fill_bitmask(bitmask, 0)


def test_special_tokens_never_inside_a_grammar(compiler, tokenizer):
    # xgrammar alone takes "<|endoftext|>" (id 0) for literal text and allows it inside a JSON string.
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    assert {0, 1, EOS} <= special
    matcher = GrammarMatcher(compiler.compile(GrammarSpec.json_schema({"type": "object", "properties": {
        "text": {"type": "string"}}, "required": ["text"]})))
    assert matcher._matcher.accept_string('{"text": "')
    bitmask = allocate_bitmask(1, VOCAB_SIZE)
    matcher.fill_bitmask(bitmask, 0)
    allowed = allowed_ids(bitmask, 0, VOCAB_SIZE)
    assert len(allowed) > 40_000 and not allowed & special
    assert not matcher.accept_token(0)


def test_logits_wider_than_the_tokenizer(tokenizer):
    # A padded lm_head (vocab_size > len(tokenizer)): the extra ids are never allowed.
    wide = VOCAB_SIZE + 64
    compiler = GrammarCompiler(tokenizer, wide, stop_token_ids=[EOS])
    matcher = GrammarMatcher(compiler.compile(GrammarSpec.regex(r"[a-z ]{1,30}")))
    bitmask = allocate_bitmask(2, wide)
    assert bitmask.shape == (2, wide // 32)
    matcher.fill_bitmask(bitmask, 1)
    allowed = allowed_ids(bitmask, 1, wide)
    assert allowed and max(allowed) < len(tokenizer)
    logits = torch.zeros(2, wide)
    apply_bitmask(logits, bitmask, [1])
    assert torch.isinf(logits[1, len(tokenizer):]).all() and not torch.isinf(logits[0]).any()


def test_json_whitespace_is_bounded(compiler, tokenizer):
    # Default: any JSON whitespace, at most 32 characters in a row (a small model cannot loop on newlines).
    json_object = compiler.compile(GrammarSpec.json_object())
    assert GrammarMatcher(json_object)._matcher.accept_string("{" + "\n" * 32)
    assert not GrammarMatcher(json_object)._matcher.accept_string("{" + "\n" * 33)
    compact = GrammarCompiler(tokenizer, VOCAB_SIZE, stop_token_ids=[EOS], json_any_whitespace=False)
    assert GrammarMatcher(compact.compile(GrammarSpec.json_object()))._matcher.accept_string('{"a": 1}')
    assert not GrammarMatcher(compact.compile(GrammarSpec.json_object()))._matcher.accept_string('{\n"a": 1}')


# ----------------------------------------------------------------- errors


@pytest.mark.parametrize("spec, fragment", [
    (GrammarSpec("json_schema", '{"type": "nonsense"}'), 'Unsupported type "nonsense"'),
    (GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}'), "missing"),
    (GrammarSpec("json_schema", '{"type": "string", "pattern": "[a-"}'), "Unclosed '['"),
    (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
    (GrammarSpec.regex("[0-9"), "Unclosed '['"),
    (GrammarSpec.regex("(ab"), "parenthesis"),
    (GrammarSpec.ebnf("root ::= foo"), 'Rule "foo" is not defined'),
    (GrammarSpec.ebnf('root ::= "a" |'), "line 1"),
])
def test_invalid_specs_raise_a_one_line_grammar_error(compiler, spec, fragment):
    with pytest.raises(GrammarError) as info:
        compiler.compile(spec)
    message = str(info.value)
    assert fragment in message
    assert message.startswith("invalid ") and "\n" not in message and ".cc:" not in message
    assert len(message) <= 260


def test_grammar_error_does_not_echo_a_huge_input(compiler):
    huge = '{"type": "object", "properties": {' + ", ".join(f'"p{i}": {{"type": "str{i}"}}' for i in range(2000)) + "}}"
    with pytest.raises(GrammarError) as info:
        compiler.compile(GrammarSpec("json_schema", huge))
    assert len(str(info.value)) <= 260
    with pytest.raises(GrammarError) as info:
        compiler.compile(GrammarSpec("json_schema", huge[:-1]))  # not JSON: xgrammar would echo it all
    assert len(str(info.value)) <= 260


def test_bad_specs_are_rejected_when_built():
    with pytest.raises(GrammarError, match="kind"):
        GrammarSpec("yaml", "a: b")
    with pytest.raises(GrammarError, match="needs a non-empty source"):
        GrammarSpec.regex("")
    with pytest.raises(GrammarError, match="takes no source"):
        GrammarSpec("json_object", "{}")
    with pytest.raises(GrammarError, match="not valid JSON"):
        GrammarSpec.json_schema('{"type": ')
    with pytest.raises(GrammarError, match="object or a boolean"):
        GrammarSpec.json_schema("[1, 2]")
    assert isinstance(GrammarError("x"), ValueError)


# ----------------------------------------------------------------- cache


def test_equal_specs_share_one_compiled_grammar(compiler):
    spec = GrammarSpec.json_schema(PERSON_SCHEMA)
    # The same schema written with other whitespace is the same spec; key order is kept (it is the
    # order the output follows), so a reordered schema is another spec.
    assert GrammarSpec.json_schema(json.dumps(PERSON_SCHEMA, indent=4)) == spec
    first = compiler.compile(spec)
    hits = compiler.cache_info().hits
    assert compiler.compile(GrammarSpec.json_schema(json.dumps(PERSON_SCHEMA))) is first
    assert compiler.cache_info().hits == hits + 1
    assert first.compile_seconds > 0 and first.memory_bytes > 0 and first.spec == spec
    reordered = dict(reversed(list(PERSON_SCHEMA.items())))
    assert GrammarSpec.json_schema(reordered) != spec


def test_concurrent_compiles_of_one_spec_compile_once(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB_SIZE, stop_token_ids=[EOS])
    spec = GrammarSpec.json_schema({**PERSON_SCHEMA, "title": "concurrent"})
    results, barrier = [], threading.Barrier(4)

    def worker():
        barrier.wait()
        results.append(compiler.compile(spec))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(r is results[0] for r in results)
    info = compiler.cache_info()
    assert info.misses == 1 and info.hits == 3 and info.num_entries == 1


def test_cache_is_a_bounded_lru(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB_SIZE, stop_token_ids=[EOS], max_cached=2)
    a, b, c = (GrammarSpec.regex(p) for p in ("a+", "b+", "c+"))
    compiled_a = compiler.compile(a)
    compiler.compile(b)
    assert compiler.compile(a) is compiled_a  # a is now the most recent: c evicts b
    compiler.compile(c)
    assert compiler.cache_info().num_entries == 2
    assert compiler.compile(a) is compiled_a
    misses = compiler.cache_info().misses
    compiler.compile(b)
    assert compiler.cache_info().misses == misses + 1
    with pytest.raises(GrammarError):
        compiler.compile(GrammarSpec.regex("(x"))  # errors are not cached
    assert compiler.cache_info().num_entries == 2


# ----------------------------------------------------------------- masks


def random_bitmask(batch, vocab_size, seed):
    generator = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(batch, vocab_size)
    bitmask.copy_(torch.randint(-2**31, 2**31, bitmask.shape, generator=generator, dtype=torch.int64).to(torch.int32))
    return bitmask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_size", [VOCAB_SIZE, 1000, 49157])
def test_apply_bitmask_matches_the_reference_and_leaves_other_rows_alone(dtype, vocab_size):
    logits = torch.randn(16, vocab_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    bitmask = random_bitmask(16, vocab_size, seed=2)
    rows = [13, 0, 5, 6, 9, 2, 15, 11]
    fast, slow = logits.clone(), logits.clone()
    apply_bitmask(fast, bitmask, rows)
    apply_bitmask_reference(slow, bitmask, rows)
    assert torch.equal(fast, slow)
    others = [r for r in range(16) if r not in rows]
    assert torch.equal(fast[others], logits[others])  # bit-identical
    masked = torch.isinf(fast[rows]).sum().item()
    assert 0.4 < masked / (len(rows) * vocab_size) < 0.6
    untouched = logits.clone()
    apply_bitmask(untouched, bitmask, [])
    assert torch.equal(untouched, logits)


def test_apply_bitmask_checks_its_inputs():
    logits = torch.zeros(4, 100)
    with pytest.raises(ValueError, match="words per row"):
        apply_bitmask(logits, allocate_bitmask(4, 64), [0])
    with pytest.raises(ValueError, match="rows must be in"):
        apply_bitmask(logits, allocate_bitmask(4, 100), [4])
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask(logits, torch.zeros(4, 4, dtype=torch.int64), [0])


def test_fill_bitmasks_fills_each_row(compiler):
    matchers = [GrammarMatcher(compiler.compile(GrammarSpec.regex(p))) for p in ("[0-9]+", "x")]
    bitmask = allocate_bitmask(4, VOCAB_SIZE)
    fill_bitmasks(matchers, bitmask, [3, 1])
    assert allowed_ids(bitmask, 0, VOCAB_SIZE) == set(range(VOCAB_SIZE))  # untouched rows stay all-allowed
    assert len(allowed_ids(bitmask, 1, VOCAB_SIZE)) == 1
    assert 10 <= len(allowed_ids(bitmask, 3, VOCAB_SIZE)) < 2000


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_on_cuda_matches_the_reference(dtype):
    logits = torch.randn(16, VOCAB_SIZE, device="cuda").to(dtype)
    bitmask = random_bitmask(16, VOCAB_SIZE, seed=3)
    rows = [1, 4, 7, 8, 10, 12, 14, 15]
    fast, slow = logits.clone(), logits.clone()
    apply_bitmask(fast, bitmask.pin_memory(), rows)
    apply_bitmask_reference(slow, bitmask, rows)
    assert torch.equal(fast, slow)
    others = [r for r in range(16) if r not in rows]
    assert torch.equal(fast[others], logits[others])


def test_importing_the_modules_does_not_import_xgrammar():
    code = ("import sys, llm_api.structured.spec, llm_api.structured.compiler, llm_api.structured.matcher, "
            "llm_api.structured.bitmask; print('xgrammar' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("depth", [65, 400, 2000])
@pytest.mark.parametrize("kind", ["json_schema", "regex", "ebnf"])
def test_nesting_over_the_depth_limit_is_refused_before_compiling(kind, depth):
    source = {"json_schema": '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth,
              "regex": "(" * depth + "a" + ")" * depth,
              "ebnf": 'root ::= ' + "(" * depth + '"a"' + ")" * depth}[kind]
    with pytest.raises(GrammarError, match=f"nests {depth + (kind == 'json_schema')} levels deep; the limit is 64"):
        check_limits(GrammarSpec(kind, source))


def test_nesting_inside_strings_and_escapes_does_not_count():
    check_limits(GrammarSpec.json_schema({"type": "string", "pattern": "[" * 30, "description": "{(" * 500}))
    check_limits(GrammarSpec.regex("\\(" * 500 + "a"))
    check_limits(GrammarSpec.regex('"' + "(a)" * 100))  # a quote is no string in a regex: still counted, shallow
    with pytest.raises(GrammarError, match="nests 65 levels"):
        check_limits(GrammarSpec.regex('"' + "(" * 65 + "a" + ")" * 65))


@pytest.mark.parametrize("schema", [{"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"},
                                    {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{(i + 1) % 5}"} for i in range(5)},
                                     "$ref": "#/$defs/d0"}])
def test_a_grammar_that_accepts_nothing_is_refused(compiler, schema):
    with pytest.raises(GrammarError, match="accepts no output"):
        compiler.compile(GrammarSpec.json_schema(schema))
