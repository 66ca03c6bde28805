"""The fused decoder layers (``llm_api.engine.fused_layers``) in the engine, on CPU under Triton's interpreter:
``fused_ops.install`` is ``enable`` without its CUDA check (the GPU machine runs the same through
``enable``, tests/engine/test_gpu_fast_path.py). The engine's greedy tokens equal ``generate()``'s in
float32; the merged products hold no second copy of a weight; what is not Llama's code, or no longer a
plain linear of the merged tensor, takes the module's own path, still right."""

from __future__ import annotations

import copy

import pytest
import torch

from engine_helpers import (TINY_CONFIGS, Doubled, greedy, make_engine, needs_cpu_triton, random_prompt, reference_greedy,
                            run_engine)
from llm_api.engine import fused_layers, fused_ops

pytestmark = needs_cpu_triton


def _model(arch: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(TINY_CONFIGS[arch](), dtype=torch.float32).eval()


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The engine's ``fused_ops.enable`` without its device check (the Triton set, under the interpreter)."""
    monkeypatch.setattr(fused_ops, "enable", lambda model, layers=True, cpu_kernels_cache=None:
                        fused_ops.install(model, layers))


def _generate_both(model, reference, **config):
    engine = make_engine(model, num_blocks=64, attention_backend="triton", cuda_graphs=False, **config)
    generator = torch.Generator().manual_seed(5)
    arrivals = {0: [("a", random_prompt(generator, 9), greedy(6))], 2: [("b", random_prompt(generator, 4), greedy(5))]}
    results = run_engine(engine, arrivals)
    for arrival in arrivals.values():
        for request_id, prompt, params in arrival:
            assert results[request_id][0] == reference_greedy(reference, prompt, params.max_new_tokens), request_id
    return engine


# (arch, decoder layers fused, attention + MLP modules merged, of 2 layers); which others are chosen:
# test_layers_are_chosen_by_their_code_below_transformers_wrapper
CASES = [
    ("llama", 2, 4),  # all of it
    ("qwen3", 2, 2),  # q/k norms in its attention: only the MLPs merge, its attention is its own code
]


@pytest.mark.parametrize("arch,layers,merged", CASES, ids=[c[0] for c in CASES])
def test_fused_layers_generate_what_generate_does(fused_on_cpu, arch, layers, merged):
    model = _model(arch)
    reference = copy.deepcopy(model)
    engine = _generate_both(model, reference)
    # (the output head too: while one sequence runs, every product of a step, the head's included, is the
    # one-row kernel's, kernels.gemv)
    assert (engine.runner.fused["layers"], engine.runner.fused["merged"], engine.runner.fused["head"]) == (
        layers, merged, 1)


def test_layers_are_chosen_by_their_code_below_transformers_wrapper():
    """Every family's decoder-layer forward is wrapped in the same checkpointing function: the choice looks
    below it. Granite scales its residuals and Phi-3 adds dropout around them: neither is Llama's layer."""
    counts = {arch: fused_ops.install(_model(arch)) for arch in ("llama", "qwen2", "mistral", "gemma2", "granite",
                                                                  "phi3")}
    # Qwen2's and Mistral's attention have a sliding window in their code: only their MLPs merge. Gemma2's
    # norm adds 1 to its weight: no layer of its is Llama's.
    assert {arch: (c["layers"], c["merged"]) for arch, c in counts.items()} == {
        "llama": (2, 4), "qwen2": (2, 2), "mistral": (2, 2), "gemma2": (0, 0), "granite": (0, 0), "phi3": (0, 0)}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_forward_gives_the_models_own_logits(arch):
    """Finer than greedy tokens: a whole forward's logits (transformers' own attention, two sequences of 6)
    agree to float32 rounding, so a kernel that is slightly off fails here even where no token flips."""
    model = _model(arch)
    reference = copy.deepcopy(model)
    fused = fused_ops.install(model)
    assert fused["layers"] == 2
    input_ids = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        logits, expected = model(input_ids).logits, reference(input_ids).logits
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=2e-5)
    fused_ops.disable(model)


def test_merged_products_share_the_modules_weights():
    model = _model("llama")
    before = sum(p.numel() for p in model.parameters())
    reference = copy.deepcopy(model)
    fused_ops.install(model)
    attention = model.model.layers[0].self_attn
    merged = fused_layers.merged_projection(attention)
    assert merged is not None
    storage = merged.weight.untyped_storage().data_ptr()
    for name in fused_layers.QKV:
        assert getattr(attention, name).weight.untyped_storage().data_ptr() == storage, name
    assert sum(p.numel() for p in model.parameters()) == before
    # The state dict still names (and holds) each projection by itself.
    state = model.state_dict()
    for name, param in reference.state_dict().items():
        assert torch.equal(state[name], param), name


def test_a_wrapped_projection_takes_the_modules_path(fused_on_cpu):
    """A projection wrapped after the merge (what LoRA does) is called through its wrapper: the wrapper's
    change shows in the output, where the merged product would have skipped it."""

    model = _model("llama")
    reference = copy.deepcopy(model)
    engine = make_engine(model, num_blocks=64, attention_backend="triton", cuda_graphs=False)
    assert engine.runner.fused["merged"] == 4
    for layer, twin in zip(model.model.layers, reference.model.layers):
        layer.mlp.up_proj = Doubled(layer.mlp.up_proj)
        twin.mlp.up_proj = Doubled(twin.mlp.up_proj)
    generator = torch.Generator().manual_seed(8)
    prompt = random_prompt(generator, 7)
    results = run_engine(engine, {0: [("w", prompt, greedy(6))]})
    assert results["w"][0] == reference_greedy(reference, prompt, 6)


def test_a_layer_called_on_another_tensor_ignores_the_handover(fused_on_cpu):
    """The handed-over norm is only for the very tensor it was computed from: a norm called on anything
    else computes its own output."""
    model = _model("llama")
    fused_ops.install(model)
    norm = model.model.layers[1].input_layernorm
    x = torch.randn(1, 3, model.config.hidden_size)
    fused_layers.hand_over(norm, x, torch.zeros_like(x))
    other = x.clone()
    assert torch.allclose(norm(other), type(norm).forward(norm, other), atol=1e-6)
    assert fused_layers._HANDOFF not in norm.__dict__  # taken once, then gone
    fused_ops.disable(model)
    assert all(fused_layers._NEXT_NORM not in m.__dict__ and "forward" not in m.__dict__ for m in model.modules())
