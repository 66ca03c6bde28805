"""PEFT LoRA adapters read from disk and checked against the loaded model, or refused with a reason.

An adapter is a PEFT adapter folder: ``adapter_config.json`` (PEFT's ``LoraConfig``) and
``adapter_model.safetensors`` (never a pickled ``adapter_model.bin``: loading one runs code).
``load_adapter(name, path, targets, max_rank, dtype)`` returns a ``LoraAdapter`` on the host, or raises
``AdapterError`` whose message names the adapter and the reason. Refused:

* a config that is not PEFT's LoRA (``peft_type``), a task other than causal LM, options whose weights
  this engine does not apply: DoRA (``use_dora``), trained biases (``bias``), ``modules_to_save``,
  ``fan_in_fan_out``, rank or alpha patterns, embedding / lm_head LoRA;
* a ``base_model_name_or_path`` whose last path component is not the loaded model's (a fine-tune of
  another model: its deltas would be applied to weights they were not trained against);
* a weight for a module the model has no wrappable linear for (``targets``: module path -> (in, out)),
  shapes that do not match that linear (A ``[r, in]``, B ``[out, r]``), a rank above MAX_LORA_RANK, a rank
  that disagrees with the config's ``r``, weights that are not finite (NaN, inf) in the file or once in the
  model's dtype, weights larger in magnitude than ``MAX_WEIGHT_ABS`` or a scaling larger than
  ``MAX_SCALING_ABS`` (bounds far above any trained adapter's: they keep one tenant's adapter from reaching
  infinities that ``llm_api.lora.ops`` and the engine must then contain);
* a config that cannot be read: too large, not JSON, not an object, or nested too deeply to parse.

Scaling is PEFT's: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``. The delta of one
module is ``(x @ A.T @ B.T) * scaling``, in that order, as PEFT's ``LoraLayer`` computes it.

Adapter names are what a client sends as ``model`` / ``adapter``, so they are restricted to a safe alphabet
(``ADAPTER_NAME``; LORA_ADAPTERS is parsed by ``llm_api.model.settings``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# What a client may call an adapter: it travels in JSON bodies, metric labels (comma-separated lists) and logs.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes
# Trained adapters' weights are of order 1 (A starts at kaiming-uniform scale, B at zero) and their scaling
# (lora_alpha / r, or / sqrt(r)) of order 0.1-100: these bounds refuse only what no training produces.
MAX_WEIGHT_ABS = 1024.0
MAX_SCALING_ABS = 1024.0
_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<which>A|B)(?:\.(?P<adapter>[^.]+))?\.weight")


class AdapterError(ValueError):
    """An adapter that cannot be served with this model and these settings (the message says why)."""


@dataclass(frozen=True)
class ModuleLora:
    """One target module's weights of one adapter (host tensors, the model's dtype)."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    modules: Mapping[str, ModuleLora]  # module path in the model ("model.layers.0.self_attn.q_proj") -> weights
    lora_id: int = 0  # set by the registry: unique per load (slots and prefix-cache keys use it, never the name)

    @property
    def num_bytes(self) -> int:
        """The adapter's own weights (what one resident copy costs, before padding to MAX_LORA_RANK)."""
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules.values())


def check_adapter_name(name: str) -> str:
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise AdapterError(f"adapter name {name!r} is not allowed: 1-64 characters of A-Z a-z 0-9 . _ -, "
                           f"starting with a letter or digit")
    return name


def _refuse(name: str, reason: str) -> AdapterError:
    return AdapterError(f"LoRA adapter {name!r} refused: {reason}")


def read_config(name: str, folder: Path) -> dict:
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise _refuse(name, f"{CONFIG_FILE} not found in its folder")
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise _refuse(name, f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(config_path.read_bytes())
    except (ValueError, UnicodeDecodeError) as err:
        raise _refuse(name, f"{CONFIG_FILE} is not valid JSON ({err})") from None
    except RecursionError:
        raise _refuse(name, f"{CONFIG_FILE} is nested too deeply to read") from None
    if not isinstance(config, dict):
        raise _refuse(name, f"{CONFIG_FILE} is not a JSON object")
    return config


def scaling_of(name: str, config: dict) -> tuple[int, float]:
    """(r, scaling) from a PEFT LoraConfig, checked."""
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if not (isinstance(r, int) and not isinstance(r, bool) and r > 0):
        raise _refuse(name, f"r={r!r} is not a positive integer")
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha)):
        raise _refuse(name, f"lora_alpha={alpha!r} is not a finite number")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    if abs(scaling) > MAX_SCALING_ABS:
        raise _refuse(name, f"its scaling (lora_alpha={alpha!r} / {'sqrt(r)' if config.get('use_rslora') else 'r'}) "
                      f"is {scaling:.3g}, beyond +-{MAX_SCALING_ABS:g}")
    return r, scaling


def _check_options(name: str, config: dict, model_name: str | None) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(name, f"peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise _refuse(name, f"task_type {config.get('task_type')!r} is not CAUSAL_LM")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") not in (None, "none"),
        "modules_to_save": bool(config.get("modules_to_save")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "trainable_token_indices": bool(config.get("trainable_token_indices")),
    }
    used = [option for option, on in unsupported.items() if on]
    if used:
        raise _refuse(name, f"it uses {', '.join(used)}, which this server does not apply")
    base = config.get("base_model_name_or_path")
    if base and model_name and _last_part(base) != _last_part(model_name):
        raise _refuse(name, f"it was trained on {base!r}, not on the loaded model {_last_part(model_name)!r}")


_GGUF_SUFFIX = re.compile(r"([.-](i?q\d[\w]*|f16|f32|bf16))?\.gguf$", re.IGNORECASE)


def _last_part(name: str) -> str:
    """A model's name to compare: the last path component, lowercased; for a GGUF file, its name without
    ``.gguf`` and the quantization tag before it (``SmolLM2-135M-Instruct.Q4_1.gguf``: the checkpoint
    ``SmolLM2-135M-Instruct`` quantized, which PEFT adapters record)."""
    return _GGUF_SUFFIX.sub("", str(name).rstrip("/").rsplit("/", 1)[-1]).lower()


def load_adapter(name: str, path: str | Path, targets: Mapping[str, tuple[int, int]], max_rank: int,
                 dtype: torch.dtype, model_name: str | None = None) -> LoraAdapter:
    """Read and check one adapter folder (see the module docstring); host tensors in ``dtype``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    check_adapter_name(name)
    folder = Path(path)
    if not folder.is_dir():
        raise _refuse(name, f"{str(path)!r} is not a folder")
    config = read_config(name, folder)
    _check_options(name, config, model_name)
    r, scaling = scaling_of(name, config)
    if r > max_rank:
        raise _refuse(name, f"rank {r} is above MAX_LORA_RANK={max_rank}")
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise _refuse(name, f"{WEIGHTS_FILE} not found in its folder (pickled .bin weights are not loaded)")
    try:
        tensors = load_file(str(weights_path), device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise _refuse(name, f"{WEIGHTS_FILE} cannot be read ({err})") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise _refuse(name, f"weight {key!r} is not a LoRA A/B weight (embedding LoRA, biases and saved "
                          f"modules are not applied)")
        module = match["module"].removeprefix(PEFT_PREFIX)
        pairs.setdefault(module, {})[match["which"]] = tensor
    if not pairs:
        raise _refuse(name, f"{WEIGHTS_FILE} holds no LoRA weights")
    modules = {}
    for module, pair in sorted(pairs.items()):
        if module not in targets:
            raise _refuse(name, f"it adapts {module!r}, which is not a supported linear of this model "
                          f"(supported: q, k, v, o, gate, up and down projections)")
        if set(pair) != {"A", "B"}:
            raise _refuse(name, f"{module!r} has lora_{next(iter(pair))} without its pair")
        a, b = pair["A"], pair["B"]
        in_features, out_features = targets[module]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_features or b.shape[0] != out_features \
                or a.shape[0] != b.shape[1]:
            raise _refuse(name, f"{module!r} has shapes A {list(a.shape)}, B {list(b.shape)}; this model needs "
                          f"A [r, {in_features}] and B [{out_features}, r]")
        if a.shape[0] != r:
            raise _refuse(name, f"{module!r} has rank {a.shape[0]}, the config says r={r}")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise _refuse(name, f"{module!r} has non-float weights")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise _refuse(name, f"{module!r} has weights that are not finite (NaN or inf)")
        largest = max(a.abs().max().item(), b.abs().max().item())
        if largest > MAX_WEIGHT_ABS:
            raise _refuse(name, f"{module!r} has a weight of magnitude {largest:.3g}, beyond {MAX_WEIGHT_ABS:g}")
        a, b = a.to(dtype).contiguous(), b.to(dtype).contiguous()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):  # (float16 overflows sooner)
            raise _refuse(name, f"{module!r} has weights that are not finite in {dtype}")
        modules[module] = ModuleLora(a, b)
    return LoraAdapter(name=name, path=str(folder), rank=r, scaling=scaling, modules=modules)
