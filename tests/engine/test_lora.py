"""LoRA adapters in the paged engine (llm_api.lora) against PEFT's own generate(), and their refusals.

Adapters are made with PEFT and random non-zero B weights (tests/lora_helpers.py); each test runs
requests of two adapters and of the base model in the same engine steps and compares every greedy answer
with PEFT's generate() for that adapter (float32). Also: the prefix cache keeps adapters apart, MAX_LORAS
below the number of adapters in flight (the scheduler holds the rest back, slots are swapped), a second
model family, and adapters refused at load with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_helpers import EMBEDDED_CHATS, KERNELS_CACHE, assert_engine_idle, greedy, tiny_model
from lora_helpers import make_adapter, peft_greedy
from llm_api.engine.engine import EngineConfig, LLMEngine
from llm_api.lora.config import AdapterError
from llm_api.lora.registry import AdapterPathError, LoraRegistry, confined_path

# (peft is imported where used, by lora_helpers: ~2.2 s, which every xdist worker would pay at collection)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def embedded(embedded_checkpoint_path):
    """(tokenizer, model for PEFT's generate, {adapter name: folder}) of the embedded model in float32."""
    oracle = AutoModelForCausalLM.from_pretrained(embedded_checkpoint_path, dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(embedded_checkpoint_path), oracle


@pytest.fixture(scope="module")
def adapters(embedded, tmp_path_factory):
    _, oracle = embedded
    root = tmp_path_factory.mktemp("adapters")
    return {
        "alpha": make_adapter(oracle, root / "alpha", seed=1, r=8, alpha=16),
        # rsLoRA scaling, a subset of the targets, another rank
        "beta": make_adapter(oracle, root / "beta", seed=2, r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"],
                             use_rslora=True, scale=1.0),
    }


@pytest.fixture(scope="module")
def kernels_cache() -> str:
    """Where the CPU kernels' library is (``llm_api.kernels.cpu``; engine_helpers.KERNELS_CACHE): an engine given it
    runs a decode step's layers whole in C, the adapters' deltas included, as a server does where a C compiler
    exists."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the CPU kernels are not built (transformers' code runs)")
    return KERNELS_CACHE


def _served_engine(model_path, adapters, max_loras: int, **config) -> tuple[LLMEngine, LoraRegistry, dict]:
    """An engine over a fresh copy of the model, stopping at the model's EOS ids as generate() does (with
    ``cpu_kernels_cache``, the CPU kernels' whole layers; without, transformers' code)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    registry = LoraRegistry(model, max_loras=max_loras, max_rank=64, model_name=str(model_path))
    ids = {name: registry.load(name, folder).lora_id for name, folder in adapters.items()}
    config.setdefault("num_blocks", 128)
    config.setdefault("max_num_batched_tokens", 512)
    return LLMEngine(model, EngineConfig(**config), eos_ids, lora=registry), registry, ids


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
    """All requests added at once, stepped to the end: request id -> tokens."""
    tokens: dict[str, list[int]] = {}
    for request_id, prompt, lora_id in requests:
        engine.add_request(request_id, prompt, greedy(MAX_NEW_TOKENS), lora_id=lora_id)
        tokens[request_id] = []
    mixed_steps = 0
    while engine.has_unfinished_requests():
        running = {r.lora_id for r in engine.scheduler.running}
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
        mixed_steps += len(running) >= 3
    assert_engine_idle(engine)
    tokens["_mixed_steps"] = [mixed_steps]
    return tokens


def _prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


@pytest.fixture(scope="module")
def peft_answers(embedded, adapters):
    """The prompts and PEFT's greedy answers: request id ("<adapter or base>-<prompt index>") -> tokens."""
    tokenizer, oracle = embedded
    prompts = [_prompt(tokenizer, text) for text in EMBEDDED_CHATS[:3]]
    expected = {}
    for i, prompt in enumerate(prompts):
        for name, folder in adapters.items():
            expected[f"{name}-{i}"] = peft_greedy(oracle, folder, prompt, MAX_NEW_TOKENS)
        with torch.no_grad():
            out = oracle.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        expected[f"base-{i}"] = out[0, len(prompt):].tolist()
    for i in range(len(prompts)):  # the adapters change the answers, or the test proves nothing
        assert expected[f"alpha-{i}"] != expected[f"base-{i}"] and expected[f"beta-{i}"] != expected[f"base-{i}"]
    return prompts, expected


@pytest.mark.parametrize("max_loras, speculative_tokens, kernels", [(2, 0, False), (1, 0, False), (2, 4, False),
                                                                   (2, 0, True), (1, 0, True)],
                         ids=["all-resident", "swapped", "speculative", "all-resident-cpu-kernels",
                              "swapped-cpu-kernels"])
def test_mixed_batch_matches_peft(peft_answers, adapters, embedded_checkpoint_path, max_loras, speculative_tokens, kernels,
                                  request):
    """Base, alpha and beta requests in the same steps: each answer is PEFT's, token for token. With
    MAX_LORAS=1 the scheduler runs one adapter at a time beside the base and the slot is swapped; with
    speculation, each drafted token is verified under its own sequence's adapter. With the CPU kernels, the
    decode steps run every layer in C with each row's own adapter's deltas (``kernels.cpu``)."""
    from llm_api.kernels import cpu as cpu_kernels

    prompts, expected = peft_answers
    cache = request.getfixturevalue("kernels_cache") if kernels else ""
    engine, registry, ids = _served_engine(embedded_checkpoint_path, adapters, max_loras,
                                           speculative_tokens=speculative_tokens, cpu_kernels_cache=cache)
    assert engine.runner.path.whole_layers == bool(kernels)
    calls = []
    if kernels:  # (a spy: the C deltas did run, on steps with adapter rows)
        original = cpu_kernels.decode_layers
        request.addfinalizer(lambda: setattr(cpu_kernels, "decode_layers", original))
        cpu_kernels.decode_layers = lambda *a, **k: calls.append(k.get("lora", a[-1])) or original(*a, **k)
    requests = [(f"{name}-{i}", prompt, ids.get(name, 0)) for i, prompt in enumerate(prompts)
                for name in ("base", "alpha", "beta")]
    got = _run(engine, requests)
    mixed_steps = got.pop("_mixed_steps")[0]
    assert got == expected
    if kernels:
        assert sum(lora is not None for lora in calls) >= MAX_NEW_TOKENS - 2
    stats = registry.stats()
    if speculative_tokens:
        assert engine.stats().spec_decode_num_accepted_tokens > 0, "no draft was accepted: speculation untested"
    if max_loras == 2:
        assert mixed_steps > 0, "base and both adapters never ran in one step"
        assert stats.num_swaps == 2
    else:
        assert stats.num_swaps >= 2 and len(stats.resident) == 1


def test_second_family_matches_peft(tmp_path):
    """A tiny random Qwen2 (bias on q/k/v) with an adapter on every target, mixed with base requests."""
    oracle = tiny_model("qwen2", seed=3)
    model_path = tmp_path / "qwen2-tiny"
    oracle.save_pretrained(model_path)
    folder = make_adapter(oracle, tmp_path / "q", seed=4, r=16, alpha=32, scale=1.0)
    prompts = [[5, 17, 42, 99, 3, 250, 7, 8, 11], [300, 301, 302, 1, 2]]
    expected = {}
    for i, prompt in enumerate(prompts):
        expected[f"q-{i}"] = peft_greedy(oracle, folder, prompt, MAX_NEW_TOKENS)
        with torch.no_grad():
            out = oracle.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected[f"base-{i}"] = out[0, len(prompt):].tolist()
        assert expected[f"q-{i}"] != expected[f"base-{i}"]
    engine, _, ids = _served_engine(model_path, {"q": folder}, 1, block_size=4)
    got = _run(engine, [(f"{name}-{i}", p, ids.get(name, 0)) for i, p in enumerate(prompts) for name in ("base", "q")])
    got.pop("_mixed_steps")
    assert got == expected


def test_prefix_cache_is_keyed_by_adapter(adapters, embedded_checkpoint_path, embedded):
    tokenizer, _ = embedded
    engine, _, ids = _served_engine(embedded_checkpoint_path, adapters, 2, block_size=16)
    prompt = _prompt(tokenizer, "Tell me about the history of the printing press in a few sentences.")
    assert len(prompt) >= 32

    def hits_after(request_id, lora_id):
        before = engine.stats().prefix_cache_hits
        _run(engine, [(request_id, prompt, lora_id)])
        return engine.stats().prefix_cache_hits - before

    assert hits_after("a1", ids["alpha"]) == 0
    assert hits_after("b1", ids["beta"]) == 0  # same prompt, another adapter: nothing shared
    assert hits_after("base1", 0) == 0  # nor with the base model
    assert hits_after("a2", ids["alpha"]) > 0  # same adapter: its blocks are reused
    assert hits_after("base2", 0) > 0


# ------------------------------------------------------------------------------------------------------
# refusals at load


def _registry(tmp_path):
    model = tiny_model("llama", seed=0)
    return model, LoraRegistry(model, max_loras=2, max_rank=16, model_name=None)


def _edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_refusals_name_the_adapter_and_the_reason(tmp_path):
    model, registry = _registry(tmp_path)
    oracle = tiny_model("llama", seed=0)
    cases = {}
    cases["rank above MAX_LORA_RANK"] = (make_adapter(oracle, tmp_path / "big", seed=1, r=32), "above MAX_LORA_RANK")
    dora = make_adapter(oracle, tmp_path / "dora", seed=1)
    _edit_config(dora, use_dora=True)
    cases["dora"] = (dora, "use_dora")
    other_base = make_adapter(oracle, tmp_path / "other", seed=1)
    _edit_config(other_base, base_model_name_or_path="someone/another-model")
    cases["base"] = (other_base, "trained on")
    nan = make_adapter(oracle, tmp_path / "nan", seed=1)
    weights = load_file(str(nan / "adapter_model.safetensors"))
    key = next(k for k in weights if "lora_B" in k)
    weights[key][0, 0] = float("nan")
    save_file(weights, str(nan / "adapter_model.safetensors"))
    cases["nan"] = (nan, "not finite")
    # an adapter of a wider model: the shapes do not fit
    wide = AutoModelForCausalLM.from_config(type(oracle.config)(**{**oracle.config.to_dict(), "hidden_size": 128}))
    cases["shapes"] = (make_adapter(wide, tmp_path / "wide", seed=1), "shapes")
    missing = tmp_path / "missing"
    missing.mkdir()
    cases["no config"] = (missing, "adapter_config.json not found")
    for case, (folder, reason) in cases.items():
        if case == "base":
            registry.model_name = "/models/tiny-llama"
        with pytest.raises(AdapterError) as refused:
            registry.load(f"case-{case.replace(' ', '-')}", folder)
        registry.model_name = None
        assert f"case-{case.replace(' ', '-')}" in str(refused.value) and reason in str(refused.value), case
    for name in ("", "../x", "a b", "x\x00", "é", "a" * 65, "-lead"):
        with pytest.raises(AdapterError, match="not allowed"):
            registry.load(name, cases["dora"][0])
    assert registry.adapters() == []


def test_runtime_paths_stay_under_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "good").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "escape").symlink_to(outside, target_is_directory=True)
    (root / "good" / "adapter_config.json").write_text("{}")
    (outside / "adapter_config.json").write_text("{}")
    (root / "linked").mkdir()
    (root / "linked" / "adapter_config.json").symlink_to(outside / "adapter_config.json")
    assert confined_path("good", str(root)) == (root / "good").resolve()
    assert confined_path(str(root / "good"), str(root)) == (root / "good").resolve()
    for bad in ("../outside", "good/../../outside", str(outside), "escape", "linked", "nope", "", "a\x00b",
                "HuggingFaceTB/some-adapter"):
        with pytest.raises(AdapterPathError):
            confined_path(bad, str(root))
    with pytest.raises(AdapterPathError):
        confined_path("good", "")
    assert os.path.isdir(root / "good")


def test_settings(tmp_path):
    from llm_api.model.settings import ConfigError, Settings

    settings = Settings.from_env({"LORA_ADAPTERS": " a=/x/a , b.2=rel/b ", "MAX_LORAS": "3", "MAX_LORA_RANK": "32"})
    assert settings.lora_adapters == (("a", "/x/a"), ("b.2", "rel/b")) and settings.max_loras == 3
    assert settings.lora_enabled and settings.max_lora_rank == 32
    assert settings.with_lora_base("/archive").lora_adapters == (("a", "/x/a"), ("b.2", "/archive/rel/b"))
    assert not Settings.from_env({}).lora_enabled
    for env, needle in [({"LORA_ADAPTERS": "a"}, "LORA_ADAPTERS"), ({"LORA_ADAPTERS": "a=/x,a=/y"}, "twice"),
                        ({"LORA_ADAPTERS": "../a=/x"}, "LORA_ADAPTERS"), ({"LORA_ADAPTERS": "a b=/x"}, "LORA_ADAPTERS"),
                        ({"MAX_LORAS": "0"}, "MAX_LORAS"), ({"MAX_LORA_RANK": "x"}, "MAX_LORA_RANK"),
                        ({"LORA_RUNTIME_LOADING": "true"}, "LORA_ADAPTER_ROOT"),
                        ({"LORA_ADAPTER_ROOT": str(tmp_path / "missing")}, "LORA_ADAPTER_ROOT"),
                        ({"LORA_ADAPTERS": "a=/x", "ENGINE": "generate"}, "ENGINE=paged")]:
        with pytest.raises(ConfigError, match=needle):
            Settings.from_env(env)


def test_hostile_values_are_refused_at_load_naming_the_reason(tmp_path):
    """Finite but huge weights, an enormous scaling either way, a config nested past any parser's depth."""
    model, registry = _registry(tmp_path)
    oracle = tiny_model("llama", seed=0)
    cases = {}
    for case, factor in (("huge-a", 3e38), ("scaled-up", 1e18)):
        folder = make_adapter(oracle, tmp_path / case, seed=1)
        weights = load_file(str(folder / "adapter_model.safetensors"))
        for key in weights:
            if case == "scaled-up" or "lora_A" in key:
                weights[key] = weights[key] * factor if case == "scaled-up" else torch.full_like(weights[key], 3e38)
            elif case == "huge-a":
                weights[key] = torch.zeros_like(weights[key])
        save_file(weights, str(folder / "adapter_model.safetensors"))
        cases[case] = (folder, "beyond 1024")
    for case, alpha in (("alpha-up", 1e30), ("alpha-down", -1e30)):
        folder = make_adapter(oracle, tmp_path / case, seed=1)
        _edit_config(folder, lora_alpha=alpha)
        cases[case] = (folder, "scaling")
    deep = make_adapter(oracle, tmp_path / "deep", seed=1)
    (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    cases["deep"] = (deep, "nested too deeply")
    for case, (folder, reason) in cases.items():
        with pytest.raises(AdapterError) as refused:
            registry.load(case, folder)
        assert case in str(refused.value) and reason in str(refused.value), (case, str(refused.value))
    assert registry.adapters() == []


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu-kernels"])
def test_a_non_finite_adapter_harms_no_other_row(tmp_path, kernels, request):
    """An adapter whose values turn infinite (past the load checks: written into the resident weights, as the
    reported attack had them, A = 3e38 and B = 0) runs in the same steps as the base model and a good adapter:
    their greedy tokens are exactly those they get without it, it ends alone with NON_FINITE, its blocks are
    zeroed before reuse and never served from the prefix cache, and the next requests are unharmed. With the
    CPU kernels too (each row's delta reads only its own adapter's columns)."""
    from llm_api.engine.request import FinishReason

    oracle = tiny_model("llama", seed=3)
    model_path = tmp_path / "llama-tiny"
    oracle.save_pretrained(model_path)
    good = make_adapter(oracle, tmp_path / "good", seed=4, r=8, alpha=16, scale=1.0)
    hostile = make_adapter(oracle, tmp_path / "hostile", seed=5, r=8, alpha=16, scale=1.0)
    cache = request.getfixturevalue("kernels_cache") if kernels else ""
    engine, registry, ids = _served_engine(model_path, {"good": good, "hostile": hostile}, 2, block_size=4,
                                           cpu_kernels_cache=cache)
    assert engine.runner.path.whole_layers == bool(kernels)
    for module in next(a for a in registry.adapters() if a.name == "hostile").modules.values():
        module.a.fill_(3e38)
        module.b.zero_()
    prompts = {"base": [5, 17, 42, 99, 3, 250, 7, 8, 11], "good": [300, 301, 302, 1, 2, 40, 41], "hostile": [9, 8, 7, 6]}

    def run(names):
        tokens, reasons = {name: [] for name in names}, {}
        for name in names:
            engine.add_request(name, prompts[name], greedy(MAX_NEW_TOKENS), lora_id=ids.get(name, 0))
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens[output.request_id].extend(output.new_token_ids)
                if output.finished:
                    reasons[output.request_id] = output.finish_reason
        assert_engine_idle(engine)
        return tokens, reasons

    together, reasons = run(["base", "good", "hostile"])
    assert reasons["hostile"] is FinishReason.NON_FINITE and together["hostile"] == []
    assert reasons["base"] is reasons["good"] is FinishReason.LENGTH
    alone, _ = run(["base", "good"])  # (the hostile adapter still resident in its slot: the same column layout)
    assert together["base"] == alone["base"] and together["good"] == alone["good"]
    assert together["good"] != together["base"]  # the good adapter does change its answer
    for cache in engine.kv_cache.key_caches + engine.kv_cache.value_caches:
        assert torch.isfinite(cache).all()  # the hostile blocks were zeroed, not left for the next tenant
    before = engine.stats().prefix_cache_hits
    again, reasons = run(["hostile"])
    assert engine.stats().prefix_cache_hits == before and reasons["hostile"] is FinishReason.NON_FINITE
