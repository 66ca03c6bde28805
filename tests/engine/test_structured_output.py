"""Structured output in the engine: token masks on constrained rows only, given to the sampler by the step's
owner, which then advances the matchers. With the embedded model (float32,
so greedy tokens compare exactly): schema-valid answers, untouched neighbours, and the generate()
reference core giving the same tokens; with a tiny random model over the embedded vocabulary: forced
preemption keeps each request's grammar state."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine_helpers import assert_engine_idle, make_engine, run_engine
from transformers import AutoModelForCausalLM, LlamaConfig

pytest.importorskip("xgrammar")

from llm_api.structured.compiler import GrammarCompiler  # noqa: E402
from llm_api.structured.matcher import GrammarMatcher, advance, step_mask  # noqa: E402
from llm_api.structured.spec import GrammarSpec  # noqa: E402
from llm_api.engine.reference import ReferenceCore  # noqa: E402
from llm_api.engine.request import FinishReason  # noqa: E402
from llm_api.engine.sampler import Sampler, SamplerBatch, SamplingState  # noqa: E402
from llm_api.engine.sampling_params import SamplingParams  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "London", "Rome", "Madrid"]}}, "required": ["name", "age", "city"]}
# A list that cannot end within the token budget: the request runs to max_new_tokens under its mask.
LONG_LIST = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 100}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"


def load_fp32(path, engine: str = "paged"):
    """``path`` loaded as a server loads it in float32 (``engine`` generate: transformers' classes, for
    ``generate()``)."""
    from llm_api.model import loader
    from llm_api.model.settings import Settings

    return loader.load(Settings.from_env({"MODEL_PATH": str(path), "DTYPE": "float32", "ENGINE": engine}))


@pytest.fixture(scope="module")
def lm(embedded_model_path):
    # Our own copy: the engine switches the model's attention to the paged one (the session's shared
    # embedded models must keep theirs for generate()).
    return load_fp32(embedded_model_path)


@pytest.fixture(scope="module")
def compiler(lm):
    return GrammarCompiler(lm.tokenizer, lm.model.config.vocab_size, lm.eos_token_ids)


def chat(lm, text: str) -> list[int]:
    return lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)


def params(compiler=None, spec=None, max_new_tokens=60, **kw) -> SamplingParams:
    grammar = compiler.compile(spec) if spec is not None else None
    return SamplingParams(max_new_tokens=max_new_tokens, grammar=grammar, **kw)


def test_sampler_masks_only_the_constrained_rows(compiler):
    vocab = compiler.vocab_size
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=generator).to(torch.bfloat16)
    row_params = [SamplingParams(), SamplingParams(grammar=compiler.compile(GrammarSpec.regex(DATE))),
                  SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=5), SamplingParams()]

    def run(matchers):
        # What the engine's step does: the matchers give the mask, the sampler applies it, the step advances them.
        states = [SamplingState.for_params(p) for p in row_params]
        token_mask = step_mask(matchers, vocab)
        token_ids = Sampler()(logits.clone(), SamplerBatch(row_params, states, [None] * 4, token_mask)).token_ids.tolist()
        advance(matchers, token_ids)
        return token_ids

    free = run([None] * 4)
    matcher = GrammarMatcher(row_params[1].grammar)
    masked = run([None, matcher, None, None])
    assert [masked[i] for i in (0, 2, 3)] == [free[i] for i in (0, 2, 3)]
    # The constrained row took the best allowed token (a digit), and advancing moved its matcher past it.
    assert compiler.tokenizer_info.decoded_vocab[masked[1]].decode().isdigit() and masked[1] != free[1]
    assert not matcher.is_completed() and not GrammarMatcher(row_params[1].grammar).accept_token(free[1])


def test_greedy_answers_follow_schema_regex_and_grammar_beside_free_rows(lm, compiler):
    ebnf = 'root ::= "The answer is " ("yes" | "no") "."'
    requests = {
        "person": (chat(lm, "Describe a person as JSON."), params(compiler, GrammarSpec.json_schema(PERSON))),
        "date": (chat(lm, "When did the Berlin wall fall?"), params(compiler, GrammarSpec.regex(DATE))),
        "ebnf": (chat(lm, "Is Paris in France?"), params(compiler, GrammarSpec.ebnf(ebnf))),
        "object": (chat(lm, "Give me some JSON."), params(compiler, GrammarSpec.json_object(), max_new_tokens=16)),
        "free1": (chat(lm, "What is the capital of France?"), params(max_new_tokens=16)),
        "free2": (chat(lm, "Name a colour."), params(max_new_tokens=16)),
    }
    engine = make_engine(lm.model, lm.eos_token_ids, block_size=16, num_blocks=128)
    together = run_engine(engine, {0: [(rid, p, sp) for rid, (p, sp) in requests.items()]})
    decode = lambda rid: lm.tokenizer.decode(together[rid][0], skip_special_tokens=True)  # noqa: E731
    for rid in ("person", "date", "ebnf"):
        assert together[rid][1] is FinishReason.STOP, (rid, decode(rid))
    jsonschema.validate(json.loads(decode("person")), PERSON)
    # (this small model nests {"type": "json", "data": {...}} without end here: cut short, but an object)
    assert decode("object").startswith("{")
    import re
    assert re.fullmatch(DATE, decode("date")) and decode("ebnf") in ("The answer is yes.", "The answer is no.")
    # The free rows got exactly what they get without constrained neighbours.
    alone = run_engine(engine, {0: [(rid, *requests[rid]) for rid in ("free1", "free2")]})
    assert alone == {rid: together[rid] for rid in ("free1", "free2")}


def test_preempted_requests_keep_their_grammar_state(lm, compiler):
    """A preempted request keeps its output tokens (recomputed, not resampled), so its matcher, which
    accepted them all, stays right: the same tokens as without preemption. A tiny random model over the
    embedded vocabulary keeps this fast; the grammar alone shapes its answers."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=compiler.vocab_size, max_position_embeddings=512), dtype=torch.float32).eval()
    eos = sorted(lm.eos_token_ids)
    prompts = [chat(lm, f"Describe person number {i} as JSON.") for i in range(4)]
    specs = [GrammarSpec.json_schema(PERSON), GrammarSpec.json_schema(LONG_LIST)] * 2

    def run(num_blocks):
        engine = make_engine(model, eos, block_size=4, num_blocks=num_blocks)
        arrivals = {0: [(f"r{i}", prompts[i], params(compiler, specs[i], max_new_tokens=64)) for i in range(2)],
                    3: [(f"r{i}", prompts[i], params(compiler, specs[i], max_new_tokens=64)) for i in range(2, 4)]}
        return run_engine(engine, arrivals), engine.stats().num_preemptions

    roomy, no_preemptions = run(400)
    tight, preemptions = run(40)
    assert no_preemptions == 0 and preemptions > 0
    assert tight == roomy
    for rid, (tokens, reason) in tight.items():
        text = lm.tokenizer.decode(tokens, skip_special_tokens=True)
        matcher = GrammarMatcher(compiler.compile(specs[int(rid[1])]))
        assert all(matcher.accept_token(t) for t in tokens), text  # every token followed the grammar
        if reason is FinishReason.STOP:
            jsonschema.validate(json.loads(text), PERSON)
        else:
            assert reason is FinishReason.LENGTH and len(tokens) == 64


def test_reference_core_gives_the_engine_tokens(lm, compiler, embedded_checkpoint_path):
    """On the float32 checkpoint: the GGUF file's quantized products round their inputs, which can turn the last
    bits in which the engine's paged attention and the reference core's differ into a different greedy token on
    some host kinds (the Intel Xeon's "free" answer parted at its second token, 2026-11-29)."""
    specs = {"person": GrammarSpec.json_schema(PERSON), "date": GrammarSpec.regex(DATE), "free": None}
    prompts = {"person": chat(lm, "Describe a person as JSON."), "date": chat(lm, "A date please."),
               "free": chat(lm, "Say hello.")}
    float_lm = load_fp32(embedded_checkpoint_path)
    engine = make_engine(float_lm.model, lm.eos_token_ids, block_size=16, num_blocks=64)
    expected = run_engine(engine, {0: [(rid, prompts[rid], params(compiler, specs[rid], max_new_tokens=40))
                                       for rid in specs]})
    core = ReferenceCore(load_fp32(embedded_checkpoint_path, "generate").model, lm.eos_token_ids,
                         lm.tokenizer.pad_token_id)
    for rid in specs:
        core.add_request(rid, prompts[rid], params(compiler, specs[rid], max_new_tokens=40))
    got: dict[str, list] = {rid: [[], None] for rid in specs}

    def collect(outputs):
        for out in outputs:
            got[out.request_id][0] += out.new_token_ids
            if out.finished:
                got[out.request_id][1] = out.finish_reason

    core.run_step(collect)
    assert {rid: tuple(v) for rid, v in got.items()} == {rid: tuple(v) for rid, v in expected.items()}


def test_ignore_eos_after_a_complete_grammar_runs_free(lm, compiler):
    """The API refuses ignore_eos with a grammar; the engine still must not break on it: once the matcher
    terminated (stop token accepted), the row is sampled unconstrained."""
    engine = make_engine(lm.model, lm.eos_token_ids, block_size=16, num_blocks=64)
    out = run_engine(engine, {0: [("r", chat(lm, "Yes or no?"), params(compiler, GrammarSpec.regex("yes|no"),
                                                                         max_new_tokens=6, ignore_eos=True))]})
    tokens, reason = out["r"]
    assert reason is FinishReason.LENGTH and len(tokens) == 6
    assert lm.tokenizer.decode(tokens[:1]) in ("yes", "no") and tokens[1] in lm.eos_token_ids
    assert_engine_idle(engine)
