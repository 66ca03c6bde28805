"""The owned decoder on the C kernel set (``llm_api.kernels.cpu``) in the engine on the CPU: what a server runs
by default where a C compiler exists (``FUSED_KERNELS``; the engine's ``cpu_kernels_cache``). A step of up to 16
rows runs every layer in one call (``kernels.cpu.decode_layers``, from the decoder's forward), decode rows,
drafted rows and prompt chunks alike (each row attends its sequence's blocks up to its own position); where the
one-call step is off or cannot run, each layer runs whole in two kernel calls around the attention
(``models.whole_layers.run_layer``; the paged attention one more call, ``kernels.cpu.paged_decode``; Qwen3's
per-head q/k norms inside ``layer_in``); a layer with a sliding window (Mistral's) runs op by op on the set, as
a prefill's many rows do (the C norms, rotary and activation, torch's products). In float32
the engine's greedy tokens equal ``generate()``'s on the tiny families and the embedded model's equal the
eager engine's; the one-call step's logprobs equal the layer by layer step's bit for bit, speculation's
verification steps included; a projection wrapped after the engine started (what LoRA does) is honoured."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from engine_helpers import (KERNELS_CACHE, TINY_CONFIGS, Doubled, greedy, make_engine, random_prompt, reference_greedy, run_engine,
                            step_outputs)
from llm_api.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the CPU kernels are not built (transformers' code runs)")


def _model(arch: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(TINY_CONFIGS[arch](), dtype=dtype).eval()


@pytest.fixture
def calls(monkeypatch):
    """How often each whole-layer kernel ran (a spy around the module's functions)."""
    counts = {"layer_in": 0, "layer_out": 0, "paged_decode": 0, "decode_layers": 0}
    for name in counts:
        original = getattr(cpu_kernels, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(cpu_kernels, name, spy)
    return counts


def _arrivals(seed: int) -> dict:
    """A long prompt (a 20-token prefill: op by op), then a second sequence joining while it decodes (steps of
    two decode rows, and one mixed step of 6 rows: whole layers, the attention by the engine's backend)."""
    generator = torch.Generator().manual_seed(seed)
    return {0: [("a", random_prompt(generator, 20), greedy(8))], 3: [("b", random_prompt(generator, 5), greedy(6))]}


# (arch, layers run whole)
CASES = [("llama", True),
         ("qwen2", True),  # (a q/k/v bias: the merged product's)
         ("mistral", True),  # a sliding window of 24 (the prompts and answers pass it): the C attention's
         ("qwen3", True)]  # (its per-head q/k norms: layer_in's)


@pytest.mark.parametrize("arch,whole", CASES, ids=[c[0] for c in CASES])
def test_cpu_kernels_generate_what_generate_does(calls, arch, whole):
    model = _model(arch)
    reference = copy.deepcopy(model)
    engine = make_engine(model, num_blocks=64, cpu_kernels_cache=KERNELS_CACHE)
    path = engine.runner.path
    assert (path.name, path.kernels, path.whole_layers) == ("owned", "CPU", True)
    arrivals = _arrivals(3)
    results = run_engine(engine, arrivals)
    for arrival in arrivals.values():
        for request_id, prompt, params in arrival:
            assert results[request_id][0] == reference_greedy(reference, prompt, params.max_new_tokens), request_id
    if whole:
        # (every step of up to 16 rows in one call, the step where b's 5-token prompt joins a's decode row
        # included; a's 20-token prompt op by op)
        assert calls["decode_layers"] > 0
        assert calls["layer_in"] == calls["layer_out"] == calls["paged_decode"] == 0
    else:
        assert calls == {"layer_in": 0, "layer_out": 0, "paged_decode": 0, "decode_layers": 0}


@pytest.mark.parametrize("dtype,speculative", [(torch.float32, 0), (torch.bfloat16, 0), (torch.float32, 3)],
                         ids=["float32", "bfloat16", "float32-speculative"])
def test_a_step_in_one_call_is_the_layer_by_layer_step(calls, dtype, speculative):
    """Three sequences decoding at once (and joining at different steps: prompt rows beside decode rows), on
    two copies of one model: with the decoder's one-call step, and with it off (each layer whole,
    ``paged_decode`` per layer); with speculation, steps of drafted rows too. Every token and every logprob
    the same, bit for bit (the same C calls in the same order)."""
    model = _model("llama", dtype)
    twin = copy.deepcopy(model)
    one_call = make_engine(model, num_blocks=64, cpu_kernels_cache=KERNELS_CACHE, speculative_tokens=speculative)
    layer_by_layer = make_engine(twin, num_blocks=64, cpu_kernels_cache=KERNELS_CACHE, speculative_tokens=speculative)
    layer_by_layer.runner.model.get_decoder().one_call_steps = False
    generator = torch.Generator().manual_seed(5)
    # (with speculation, prompts that repeat themselves: the n-gram lookup finds drafts in them)
    arrivals = {step: [(f"r{step}", random_prompt(generator, 3 + step) * (3 if speculative else 1),
                        greedy(9, logprobs=2))] for step in (0, 2, 5)}

    assert step_outputs(one_call, arrivals, 40) == (expected := step_outputs(layer_by_layer, arrivals, 40))
    assert calls["decode_layers"] > 0 and calls["paged_decode"] == 2 * calls["decode_layers"]
    assert calls["layer_in"] == calls["paged_decode"]  # (the twin's every step whole, none op by op)
    if speculative:
        assert one_call.stats().spec_decode_num_drafts > 0 and one_call.stats() == layer_by_layer.stats()
    assert sum(len(ids) for steps in expected.values() for ids, _ in steps) == 27
    assert one_call.runner.model.get_decoder().stack is not None
    assert layer_by_layer.runner.model.get_decoder().stack is None


def test_without_a_cache_folder_the_engine_runs_the_torch_set(calls):
    engine = make_engine(_model("llama"), num_blocks=16)
    assert (engine.runner.path.kernels, engine.runner.path.whole_layers) == ("torch", False)
    run_engine(engine, {0: [("a", [5, 6, 7], greedy(3))]})
    assert calls == {"layer_in": 0, "layer_out": 0, "paged_decode": 0, "decode_layers": 0}


def test_a_projection_wrapped_later_is_honoured(calls):
    """A projection wrapped after the engine made its layer plans (what a LoRA wrapper does) is called
    through its wrapper: the plan is remade and the layer runs op by op."""

    model = _model("llama")
    reference = copy.deepcopy(model)
    engine = make_engine(model, num_blocks=64, cpu_kernels_cache=KERNELS_CACHE)
    generator = torch.Generator().manual_seed(8)
    first = random_prompt(generator, 6)
    assert run_engine(engine, {0: [("before", first, greedy(4))]})["before"][0] == reference_greedy(reference, first, 4)
    assert calls["decode_layers"] > 0
    for layer, twin in zip(model.model.layers, reference.model.layers):
        layer.self_attn.o_proj = Doubled(layer.self_attn.o_proj)
        twin.self_attn.o_proj = Doubled(twin.self_attn.o_proj)
    calls["decode_layers"] = 0
    prompt = random_prompt(generator, 7)
    assert run_engine(engine, {0: [("after", prompt, greedy(6))]})["after"][0] == reference_greedy(reference, prompt, 6)
    assert calls["layer_in"] == calls["decode_layers"] == 0


def test_the_embedded_model_decodes_as_without_kernels(calls, embedded_lm_fp32):
    """The real model (SmolLM2-135M, float32), four sequences at once: every token as the eager engine's."""
    from llm_api.engine.engine import EngineConfig, LLMEngine
    from llm_api.engine.sampling_params import SamplingParams

    model = embedded_lm_fp32.model
    prompts = [embedded_lm_fp32.tokenizer.encode(text) for text in (
        "The capital of France is", "def fibonacci(n):", "Once upon a time,", "List three colours:")]

    def run(cache: str) -> list[list[int]]:
        engine = LLMEngine(model, EngineConfig(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256,
                                               cpu_kernels_cache=cache), set())
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens[output.request_id] += output.new_token_ids
        return [tokens[str(i)] for i in range(len(prompts))]

    with_kernels = run(KERNELS_CACHE)
    assert calls["decode_layers"] >= 11
    assert with_kernels == run("")
