"""The owned decoder on the Triton kernel set in the engine, on CPU under Triton's interpreter (the runner's
kernel choice made to return the Triton set; on a GPU the engine chooses it itself,
tests/engine/test_gpu_fast_path.py): norms and residual sums in one kernel each, the rotary and the K/V store in
one (with the Triton attention backend), merged q/k/v and gate/up products, a one-row step's products (the
output head's included) by ``kernels.gemv``. The engine's greedy tokens equal ``generate()``'s in float32; a
projection wrapped after the engine started (what LoRA does) takes the module's own path, still right."""

from __future__ import annotations

import copy

import pytest
import torch

from engine_helpers import TINY_CONFIGS, Doubled, greedy, make_engine, needs_cpu_triton, random_prompt, reference_greedy, \
    run_engine
from llm_api.engine import model_runner
from llm_api.kernels.triton_set import TRITON_KERNELS

pytestmark = needs_cpu_triton


def _model(arch: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(TINY_CONFIGS[arch](), dtype=torch.float32).eval()


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """The runner's kernel choice without its device check: the Triton set, under the interpreter."""
    monkeypatch.setattr(model_runner, "choose_kernel_set", lambda model, fused, cache: TRITON_KERNELS)


@pytest.fixture
def gemv_rows(monkeypatch):
    """How many products ran as the one-row kernel (a spy on the Triton set's ``row_product``)."""
    from llm_api.kernels import gemv

    calls = []
    original = gemv.row_product

    def spy(x, weight, bias=None, silu_mul=False):
        calls.append(tuple(weight.shape))
        return original(x, weight, bias, silu_mul=silu_mul)

    monkeypatch.setattr(gemv, "row_product", spy)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_the_triton_set_generates_what_generate_does(triton_on_cpu, gemv_rows, arch):
    """Llama whole; Qwen3 with its q/k norms; Mistral with its sliding window of 24 (the prompts and outputs
    pass it). A lone sequence's decode steps run every product, the head's too, as one row."""
    model = _model(arch)
    reference = copy.deepcopy(model)
    engine = make_engine(model, num_blocks=64, attention_backend="triton", cuda_graphs=False)
    assert (engine.runner.path.name, engine.runner.path.kernels) == ("owned", "Triton")
    generator = torch.Generator().manual_seed(5)
    arrivals = {0: [("a", random_prompt(generator, 20), greedy(8))], 2: [("b", random_prompt(generator, 4), greedy(5))]}
    results = run_engine(engine, arrivals)
    for arrival in arrivals.values():
        for request_id, prompt, params in arrival:
            assert results[request_id][0] == reference_greedy(reference, prompt, params.max_new_tokens), request_id
    head = tuple(model.get_output_embeddings().weight.shape)
    assert head in gemv_rows  # (the steps where "a" decoded alone)


def test_a_wrapped_projection_takes_the_modules_path(triton_on_cpu):
    """A projection wrapped after the merge (what LoRA does) is called through its wrapper: the wrapper's
    change shows in the output, where the merged product would have skipped it."""
    model = _model("llama")
    reference = copy.deepcopy(model)
    engine = make_engine(model, num_blocks=64, attention_backend="triton", cuda_graphs=False)
    layer = engine.runner.model.get_decoder().layers[0]
    assert layer.gate_up is not None and layer.gate_up.holds(layer.mlp)
    for layer, twin in zip(model.model.layers, reference.model.layers):
        layer.mlp.up_proj = Doubled(layer.mlp.up_proj)
        twin.mlp.up_proj = Doubled(twin.mlp.up_proj)
    assert not engine.runner.model.get_decoder().layers[0].gate_up.holds(model.model.layers[0].mlp)
    generator = torch.Generator().manual_seed(8)
    prompt = random_prompt(generator, 7)
    results = run_engine(engine, {0: [("w", prompt, greedy(6))]})
    assert results["w"][0] == reference_greedy(reference, prompt, 6)
