"""What a kernel set provides: the functions the owned decoder (``llm_api.models``) calls, declared once (``typing.Protocol``).

Three sets implement them: the torch set (``llm_api.kernels.torch_set.TORCH_KERNELS``: transformers' arithmetic,
any device), the Triton set (``llm_api.kernels.triton_set.TRITON_KERNELS``: CUDA, and on a CPU
under Triton's interpreter in the tests) and the C set (the module ``llm_api.kernels.cpu``, compiled for the
host). A forward holds one set and calls it; it never asks a set for a function by name.

``KernelSet``, every set: whether the set runs for a tensor (``takes``), the few-row product and when it takes
one (``takes_product``, ``row_product``, which may apply SiLU x up to its input first), RMSNorm alone and after
a residual sum, SiLU x up, and the rotary embedding of q and k (where ``rotary_supported``). Each function's
contract is the Triton kernel's of the same name (``llm_api.kernels.gemv``, ``.rms_norm``, ``.activation``,
``.rotary``), with transformers' rounding.

``WholeLayerKernels``, a set that also runs a Llama decoder layer of a few rows (at most ``max_rows(dtype)``) in
two calls around its attention (``layer_in``, ``layer_out``), a step's paged attention in one
(``paged_decode``) and a step's every layer in one (``decode_layers``), planned once as its ``LayerWeights`` and
``DecodeStack`` over its ``Product``s, with LoRA deltas inside (``LoraRows``, ``LoraProducts``): the C set
(``llm_api.kernels.cpu.layers`` states those contracts). ``runs_whole_layers(kernels)`` is how a forward decides
to plan whole layers: a declared capability (the set has every member of ``WholeLayerKernels``), not a probe for
one function. Each set's conformance is checked by tests/kernels/test_kernel_set.py, and statically by mypy where
a set is handed over.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeGuard, runtime_checkable

import torch


@runtime_checkable
class KernelSet(Protocol):
    name: str  # (the start-up log's name for the set)
    # The set's rotary may also store k and v into the paged cache in the same launch, where the attention backend
    # ``attends_stored_rows`` (the Triton set's ``kernels.rotary.rotary_store_kv``).
    rotary_stores_kv: bool

    def takes(self, tensor: torch.Tensor) -> bool: ...

    def takes_product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool: ...

    def row_product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    silu_mul: bool = False) -> torch.Tensor: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotary_supported(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool: ...

    def apply_rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class WholeLayerKernels(KernelSet, Protocol):
    # The plans' types (classes of the set: a forward builds them, the set's calls read them)
    Product: Any
    LayerWeights: Any
    DecodeStack: Any
    LoraRows: Any
    LoraProducts: Any

    def max_rows(self, dtype: torch.dtype) -> int: ...

    def layer_in(self, weights: Any, hidden: torch.Tensor, normed: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, lora: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def layer_out(self, weights: Any, attention: torch.Tensor, hidden: torch.Tensor,
                  lora: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def paged_decode(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scaling: float, window: int | None = None) -> torch.Tensor: ...

    def decode_layers(self, stack: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], slots: torch.Tensor,
                      block_tables: torch.Tensor, context_lens: torch.Tensor,
                      lora: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None: ...


# id(kernel set) -> (the set, held so its id is not reused; runs_whole_layers). A set is a module or a singleton.
_WHOLE_LAYERS: dict[int, tuple[Any, bool]] = {}


def runs_whole_layers(kernels: KernelSet) -> TypeGuard[WholeLayerKernels]:
    """Whether ``kernels`` is a ``WholeLayerKernels``, answered once a set: a forward asks once per layer and step,
    and a protocol's ``isinstance`` reads each of its members."""
    known = _WHOLE_LAYERS.get(id(kernels))
    if known is None:
        known = _WHOLE_LAYERS[id(kernels)] = (kernels, isinstance(kernels, WholeLayerKernels))
    return known[1]
