"""Fused GPU kernels for a model's small per-layer operations: RMSNorm and rotary embedding (issue 26);
with ``layers``, whole Llama-code decoder layers too (``llm_api.engine.fused_layers``, issue 39).

At batch 1 a decode step of Llama-3.1-8B on an H200 read its weights in 3.6 ms but took 6.4: the
transformers code around the matrix products launches ~37 small kernels per layer (eight per RMSNorm,
ten for the rotary embedding, casts, residual sums), ~1,200 a step, and even replayed from a CUDA graph
each costs ~2 us (docs/benchmarks.md, "Measured on an H200"). ``enable(model)`` swaps in one Triton kernel for each
RMSNorm call and one for each layer's rotary embedding of q and k (``llm_api.kernels.rms_norm``,
``llm_api.kernels.rotary``), on CUDA only. Hand-written rather than ``torch.compile``: the engine
captures its own CUDA graphs around a forward that calls the paged attention's Triton kernels through
transformers' attention interface, and compiling that forward for every captured batch size would cost
minutes at start; these two kernels are exactly the code they replace.

What is swapped is decided by code identity, not by family names: a norm module whose ``forward`` is
the same bytecode (and global names) as ``LlamaRMSNorm.forward``, and a modeling module whose
``apply_rotary_pos_emb`` and ``rotate_half`` are the same bytecode as Llama's. So Mistral, Qwen2/3,
Granite and others with copied code are covered, and a family with its own variant (Gemma's ``1 +
weight``, Olmo2's order of rounding, partial rotary) keeps its code.

The norms are swapped on the instances (``module.forward``, a bound method, so a deep copy of the model
gets forwards bound to its own modules). The rotary function is a global of its modeling module, called
by the attention's forward, so it is replaced there by a dispatcher that runs the fused kernel only inside
a forward of a model ``enable`` was called on (its ``forward`` is wrapped to say so; a model whose forward
someone else already wrapped, an accelerate hook, keeps transformers' rotary), for CUDA tensors the kernel
takes, and the original code in every other case: another model of the same family in the process (a
reference ``generate()`` in the tests) keeps transformers' code.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import sys
import types
from typing import Any

import torch
from torch import nn

from llm_api.engine import fused_layers
from llm_api.kernels.kernel_set import KernelSet
from llm_api.kernels.triton_set import TRITON_KERNELS

logger = logging.getLogger(__name__)

# The kernel set of the fused model whose forward is running (None outside one): the rotary dispatcher,
# a global of the modeling module, serves every model of the family in the process.
_IN_FUSED_FORWARD: contextvars.ContextVar[Any] = contextvars.ContextVar("llm_api_fused_forward", default=None)


_llama = fused_layers.llama_modeling


def _fused_norm(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    handed = fused_layers.take_handed(self, hidden_states)  # (computed by the layer before, in its last kernel)
    if handed is not None:
        return handed
    kernels = fused_layers.kernels_of(self)
    if not kernels.takes(hidden_states):
        return type(self).forward(self, hidden_states)
    return kernels.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _fused_norm_forward(module: nn.Module) -> types.MethodType:
    """The fused forward, bound to ``module`` (a bound method: ``copy.deepcopy`` rebinds it to the copy)."""
    return types.MethodType(_fused_norm, module)


def _fused_model_forward(self: Any, *args, **kwargs):
    token = _IN_FUSED_FORWARD.set(fused_layers.kernels_of(self))
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _IN_FUSED_FORWARD.reset(token)


_FUSED_FORWARDS = (_fused_norm, _fused_model_forward)
_ROTARY_ORIGINALS: dict[Any, Any] = {}  # each installed dispatcher -> the function it replaced


def _rotary_dispatcher(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        kernels = _IN_FUSED_FORWARD.get()
        if (kernels is not None and unsqueeze_dim == 1 and kernels.takes(q)
                and kernels.rotary_supported(q, k, cos, sin)):
            return kernels.apply_rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    _ROTARY_ORIGINALS[apply_rotary_pos_emb] = original
    return apply_rotary_pos_emb


def _original_rotary(function: Any) -> Any:
    """transformers' function behind a dispatcher installed earlier (else the function itself)."""
    return _ROTARY_ORIGINALS.get(function, function)


def fusable_norms(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward is Llama's RMSNorm code (and that no accelerate hook wraps)."""
    llama_norm = _llama().LlamaRMSNorm.forward
    return [m for m in model.modules() if fused_layers.same_code(type(m).forward, llama_norm) and not hasattr(m, "_hf_hook")
            and not _overridden(m)]


def _is_fused(forward: Any) -> bool:
    return getattr(forward, "__func__", None) in _FUSED_FORWARDS


def _overridden(module: nn.Module) -> bool:
    """Whether the instance has a forward of its own that is not ours (then it is left alone)."""
    forward = module.__dict__.get("forward")
    return forward is not None and not _is_fused(forward)


def rotary_modeling_modules(model: nn.Module) -> list[types.ModuleType]:
    """The modeling modules of ``model``'s attention layers whose rotary code is Llama's."""
    llama = _llama()
    llama_rotary = _original_rotary(llama.apply_rotary_pos_emb)
    found = []
    for name in sorted({type(m).__module__ for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")}):
        modeling = sys.modules.get(name)
        function = _original_rotary(getattr(modeling, "apply_rotary_pos_emb", None))
        if (modeling is not None and fused_layers.same_code(function, llama_rotary)
                and fused_layers.same_code(getattr(modeling, "rotate_half", None), llama.rotate_half)):
            found.append(modeling)
    return found


NOTHING_FUSED = {"rms_norm": 0, "rotary": 0, "layers": 0, "merged": 0, "head": 0, "stack": 0}


def enable(model: nn.Module, layers: bool = True, cpu_kernels_cache: str | None = None) -> dict[str, int]:
    """Swap in the fused kernels where ``model``'s code allows (call once, before any CUDA graph is
    captured): Triton's on CUDA; on the CPU, with ``cpu_kernels_cache`` (the cache folder under which
    ``llm_api.kernels.cpu`` builds its library), the C kernels, where they build. With ``layers``, also the fused decoder layers
    (``llm_api.engine.fused_layers``). Returns what was swapped: {"rms_norm": modules, "rotary": modeling
    modules, "layers": decoder layers, "merged": attention and MLP modules whose projections run as one
    product, "head": 1 where the output head's few-row product is the kernel set's, "stack": 1 where a step
    of a few rows runs its layers in one kernel-set call (the CPU set)}."""
    from llm_api.kernels import triton_usable

    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    if device.type == "cuda" and triton_usable(device):
        return install(model, layers)
    if device.type == "cpu" and cpu_kernels_cache is not None and all(p.device.type == "cpu" for p in model.parameters()):
        from llm_api.kernels import cpu as cpu_kernels

        if cpu_kernels.load(cpu_kernels_cache):
            return install(model, layers, cpu_kernels)
    disable(model)  # (an earlier engine on this model may have installed them)
    return dict(NOTHING_FUSED)


def install(model: nn.Module, layers: bool = True, kernels: KernelSet = TRITON_KERNELS) -> dict[str, int]:
    """``enable`` without its device check, with the kernel set given (the Triton set runs on CPU only under
    Triton's interpreter: the tests, tests/engine/test_fused_layers.py)."""
    norms = fusable_norms(model)
    for module in norms:
        fused_layers.set_kernels(module, kernels)
        if "forward" not in module.__dict__:  # (already swapped by an earlier engine on this model)
            module.forward = _fused_norm_forward(module)
    modeling_modules = rotary_modeling_modules(model)
    for modeling in modeling_modules:
        namespace = vars(modeling)  # (the attention's forward looks the function up here at each call)
        if namespace["apply_rotary_pos_emb"] not in _ROTARY_ORIGINALS:
            namespace["apply_rotary_pos_emb"] = _rotary_dispatcher(namespace["apply_rotary_pos_emb"])
    rotary = len(modeling_modules)
    fused_layers.set_kernels(model, kernels)
    if rotary and "forward" not in model.__dict__:
        model.forward = types.MethodType(_fused_model_forward, model)
    elif rotary and not _is_fused(model.__dict__["forward"]):  # (someone else's wrapper: leave it be)
        rotary = 0
    fused = dict(NOTHING_FUSED, rms_norm=len(norms), rotary=rotary)
    if layers:
        fused.update(fused_layers.enable(model, norms, modeling_modules if rotary else [], kernels))
    else:
        fused_layers.disable(model)
        for module in [*norms, model]:
            fused_layers.set_kernels(module, kernels)  # (disable dropped them; the norms still run fused)
    logger.info("fused %s kernels: %d RMSNorm modules, rotary embedding in %d modeling modules, %d decoder layers "
                "(%d attention and MLP modules with merged products)%s", kernels.name, len(norms), rotary, fused["layers"],
                fused["merged"], "; a step of a few rows in one call" if fused["stack"] else "")
    return fused


def disable(model: nn.Module) -> None:
    """Undo ``enable`` on ``model`` (its modules' own forwards again; the rotary dispatchers stay, inactive
    outside a fused model's forward)."""
    fused_layers.disable(model)
    for module in model.modules():
        if _is_fused(module.__dict__.get("forward")):
            del module.forward
