"""Each kernel set implements the protocol it is used as (llm_api.kernels.kernel_set): every member present, every
function taking the protocol's parameters by the same names in the same order; and the capability a forward
reads (``runs_whole_layers``) is the protocol's, which an object missing one member fails."""

from __future__ import annotations

import inspect
import types

import pytest

from llm_api.kernels import cpu as cpu_kernels
from llm_api.kernels.kernel_set import KernelSet, WholeLayerKernels, runs_whole_layers
from llm_api.kernels.torch_set import TORCH_KERNELS
from llm_api.kernels.triton_set import TRITON_KERNELS


def _members(protocol: type) -> dict[str, object]:
    """The protocol's declared members (functions, and annotated attributes as None)."""
    members: dict[str, object] = {}
    for klass in reversed(protocol.__mro__):
        if klass is object or klass.__name__ in ("Protocol", "Generic"):
            continue
        members.update({name: None for name in getattr(klass, "__annotations__", {})})
        members.update({name: value for name, value in vars(klass).items()
                        if inspect.isfunction(value) and not name.startswith("_")})
    return members


def _parameters(function) -> list[str]:
    return [p.name for p in inspect.signature(function).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("kernels, protocol", [(cpu_kernels, WholeLayerKernels), (TRITON_KERNELS, KernelSet),
                                               (TORCH_KERNELS, KernelSet)], ids=["cpu", "triton", "torch"])
def test_each_set_implements_its_protocol_by_name_and_parameters(kernels, protocol):
    assert isinstance(kernels, protocol)
    members = _members(protocol)
    assert {"takes", "row_product", "rms_norm"} <= set(members)  # (the reading above found the functions)
    for name, declared in members.items():
        assert hasattr(kernels, name), name
        if declared is not None:
            assert _parameters(getattr(kernels, name)) == _parameters(declared), name


def test_only_the_cpu_set_runs_whole_layers():
    assert runs_whole_layers(cpu_kernels)
    assert not runs_whole_layers(TRITON_KERNELS) and not runs_whole_layers(TORCH_KERNELS)


def test_a_set_missing_one_member_is_not_one():
    partial = types.SimpleNamespace(**{name: getattr(cpu_kernels, name) for name in _members(WholeLayerKernels)
                                       if name != "decode_layers"})
    assert isinstance(partial, KernelSet)
    assert not isinstance(partial, WholeLayerKernels)
    assert not runs_whole_layers(partial)  # type: ignore[arg-type]


def test_what_a_fused_forward_may_ask_of_an_attention_backend_is_declared():
    """A forward asks the backend's declared capabilities (llm_api.engine.attention.base), never its name or
    whether it happens to have a method: the Triton backend attends rows its caller stored (its rotary kernel
    wrote them), the torch backend's attention is what the C set's paged_decode computes itself."""
    from llm_api.engine.attention.base import AttentionBackend
    from llm_api.engine.attention.torch_backend import TorchBackend
    from llm_api.engine.attention.triton_backend import TritonBackend

    assert (TritonBackend.attends_stored_rows, TritonBackend.kernel_set_may_attend) == (True, False)
    assert (TorchBackend.attends_stored_rows, TorchBackend.kernel_set_may_attend) == (False, True)
    assert TorchBackend.attend is AttentionBackend.attend  # (the base's refusal: it declares no such call)
    with pytest.raises(NotImplementedError):
        TorchBackend().attend(None, 0, None, 1.0, None, None)  # type: ignore[arg-type]
