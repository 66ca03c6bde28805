"""Where a module of a loaded model computes, when accelerate may have placed or offloaded it.

For a module that accelerate offloads (DEVICE_MAP "cpu" entries on a GPU machine, or "disk" entries), the
weights sit on ``meta`` or in CPU memory and a hook moves them in for each forward, so the module
*runs* on the hook's ``execution_device``, not on its weights' device. ``execution_device(model, module)``
answers that question for the engine (where each layer's KV cache lives, where input ids and logits go)
and for the loader.
"""

from __future__ import annotations

import torch
from torch import nn


def _hook_execution_device(module: nn.Module) -> torch.device | None:
    hook = getattr(module, "_hf_hook", None)
    # accelerate chains several hooks in a SequentialHook; any of them may move the inputs.
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    return None


def execution_device(model: nn.Module, module: nn.Module) -> torch.device:
    """Where ``module`` (a submodule of ``model``) computes: the nearest accelerate hook's execution device
    on the path from ``model`` down to ``module``, else the device of its first parameter or buffer."""
    path = [model]
    for name, candidate in model.named_modules():
        if candidate is module:
            parent = model
            for part in name.split(".") if name else []:
                parent = getattr(parent, part)
                path.append(parent)
            break
    for candidate in reversed(path):
        device = _hook_execution_device(candidate)
        if device is not None:
            return device
    tensor: torch.Tensor | None = next(module.parameters(), None)
    if tensor is None:
        tensor = next(module.buffers(), None)
    device = tensor.device if tensor is not None else torch.device("cpu")
    if device.type == "meta":
        raise NotImplementedError(f"{type(module).__name__} has its weights on 'meta' with no accelerate hook to "
                                  f"move them in: the engine cannot tell where it runs")
    return device
