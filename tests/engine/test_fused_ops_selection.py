"""Which modules ``llm_api.engine.fused_ops`` swaps for the fused kernels, decided by bytecode (checked here
on CPU, where ``enable`` itself changes nothing); tests/engine/test_gpu_fast_path.py runs them in the engine
on a GPU against generate(), tests/kernels/test_fused_kernels.py checks the kernels."""

from __future__ import annotations

from transformers import AutoModelForCausalLM

from engine_helpers import TINY_CONFIGS
from llm_api.engine import fused_ops


def _counts() -> dict[str, tuple[int, int, int]]:
    """arch -> (norms to swap, modeling modules whose rotary to swap, layers)."""
    counts = {}
    for arch in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt2"):
        model = AutoModelForCausalLM.from_config(TINY_CONFIGS[arch]())
        layers = model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") else model.config.n_layer
        counts[arch] = (len(fused_ops.fusable_norms(model)), len(fused_ops.rotary_modeling_modules(model)), layers)
    return counts


def test_swaps_follow_the_code_not_the_family_name():
    """Llama, Mistral, Qwen2 and Qwen3 (its q/k norms too) run Llama's norm and rotary code; Gemma2's norm
    adds 1 to its weight, so only its rotary is Llama's; GPT-2 has neither."""
    # Llama's own function already replaced by the dispatcher (a Llama engine started first) changes nothing.
    llama = fused_ops._llama()
    original = llama.apply_rotary_pos_emb
    llama.apply_rotary_pos_emb = dispatcher = fused_ops._rotary_dispatcher(original)
    try:
        counts = _counts()
    finally:
        llama.apply_rotary_pos_emb = original
        del fused_ops._ROTARY_ORIGINALS[dispatcher]
    assert _counts() == counts
    for arch in ("llama", "mistral", "qwen2"):
        norms, rotary, layers = counts[arch]
        assert (norms, rotary) == (2 * layers + 1, 1), arch
    norms, rotary, layers = counts["qwen3"]
    assert (norms, rotary) == (4 * layers + 1, 1)
    assert counts["gemma2"][:2] == (0, 1)
    assert counts["gpt2"][:2] == (0, 0)


def test_enable_leaves_cpu_models_alone():
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS["llama"]())
    forward = model.forward
    assert fused_ops.enable(model) == fused_ops.NOTHING_FUSED == {"rms_norm": 0, "rotary": 0, "layers": 0, "merged": 0,
                                                                 "head": 0, "stack": 0}
    assert model.forward == forward


def test_disable_restores_the_modules_own_forwards():
    """``enable``'s swaps, made by hand on CPU (it makes none there), are what ``disable`` removes; a forward
    that some other code set on an instance is neither swapped nor removed."""
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS["llama"]())
    norms = fused_ops.fusable_norms(model)
    foreign = norms[0]
    foreign.forward = lambda hidden_states: hidden_states  # e.g. a hook library's
    for module in norms[1:]:
        module.forward = fused_ops._fused_norm_forward(module)
    assert foreign not in fused_ops.fusable_norms(model) and norms[1] in fused_ops.fusable_norms(model)
    fused_ops.disable(model)
    assert all("forward" not in m.__dict__ for m in norms[1:]) and "forward" in foreign.__dict__


def test_swapped_forwards_follow_a_deep_copy():
    """A copy of a model with swapped norms runs its own weights, not the original's (bound methods)."""
    import copy

    model = AutoModelForCausalLM.from_config(TINY_CONFIGS["llama"]())
    for module in fused_ops.fusable_norms(model):
        module.forward = fused_ops._fused_norm_forward(module)
    copied = copy.deepcopy(model)
    for original, twin in zip(fused_ops.fusable_norms(model), fused_ops.fusable_norms(copied)):
        assert twin.forward.__self__ is twin and original.forward.__self__ is original
    fused_ops.disable(copied)
    assert all("forward" not in m.__dict__ for m in copied.modules())
