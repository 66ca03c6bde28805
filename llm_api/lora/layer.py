"""The wrapper that adds LoRA deltas to a target linear, and the model walk that installs it.

``LoraLinear(base, slots)`` calls the wrapped module unchanged (``y = base(x)``: any module with
``in_features`` / ``out_features``, an ``nn.Linear`` or a packed-weight linear alike; its weights are never
read here) and, inside a ``lora_step`` with adapter rows, adds each row's adapter delta
(``ModuleSlots.add_delta``). Weights are never merged into the base: the base rows of a mixed batch get
exactly the base model's output.

``wrap_targets(model)`` replaces every module named like a supported target (``TARGET_NAMES``: the q, k,
v, o, gate, up and down projections) that has ``in_features`` / ``out_features``, and returns them by
module path (the path PEFT's weight names use, below ``base_model.model.``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llm_api.lora.context import current_step
from llm_api.lora.ops import ModuleSlots

TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, slots: ModuleSlots):
        super().__init__()
        self.base = base
        linear: Any = base  # (any module with the two sizes; nn.Module's __getattr__ is typed Tensor | Module)
        self.in_features: int = int(linear.in_features)
        self.out_features: int = int(linear.out_features)
        self.slots = slots  # a plain object: the adapters' weights are no part of the model's state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = current_step()
        if step is None:
            return y
        return self.slots.add_delta(x, y, step)


def wrap_targets(model: nn.Module, max_loras: int) -> dict[str, LoraLinear]:
    wrapped: dict[str, LoraLinear] = {}
    for path, module in list(model.named_modules()):
        leaf = path.rsplit(".", 1)[-1]
        if leaf not in TARGET_NAMES or isinstance(module, LoraLinear):
            continue
        if not (hasattr(module, "in_features") and hasattr(module, "out_features")):
            continue
        parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
        wrapper = LoraLinear(module, ModuleSlots(max_loras))
        setattr(parent, leaf, wrapper)
        wrapped[path] = wrapper
    return wrapped
