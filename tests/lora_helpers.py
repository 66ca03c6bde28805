"""Random PEFT LoRA adapters for the LoRA tests, made with PEFT itself (its config and weight names).

PEFT initializes every ``lora_B`` to zero (an untrained adapter changes nothing), so ``make_adapter``
fills A and B with seeded noise large enough to change the greedy answers: a test that compared
zero-B adapters with the base model would pass with LoRA ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model, folder: Path, seed: int, r: int = 8, alpha: float = 16, targets=None,
                 use_rslora: bool = False, scale: float = 0.5) -> Path:
    """Save a PEFT adapter of ``model`` (left unchanged) with random non-zero A and B into ``folder``."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, lora_dropout=0.0,
                        use_rslora=use_rslora, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                noise = torch.randn(param.shape, generator=generator) * scale / param.shape[-1] ** 0.5
                param.copy_(noise.to(param.dtype))
    peft_model.save_pretrained(str(folder))
    peft_model.unload()  # (takes the LoRA layers out of ``model`` again)
    return folder


# The red team's adapters (issue 34) and the reason each refusal must name: finite lora_A of 3e38 with zero
# lora_B (inf x 0 = NaN once multiplied), an enormous lora_alpha, and a config nested deeper than any parser goes.
HOSTILE_ADAPTERS = {"huge": "beyond 1024", "loud": "scaling", "deep": "nested too deeply"}


def make_hostile_adapters(model, root: Path) -> None:
    """Write each of HOSTILE_ADAPTERS into ``root`` under its name."""
    huge = make_adapter(model, root / "huge", seed=17, r=2, targets=["q_proj"])
    weights = load_file(str(huge / "adapter_model.safetensors"))
    save_file({k: torch.full_like(v, 3e38) if "lora_A" in k else torch.zeros_like(v) for k, v in weights.items()},
              str(huge / "adapter_model.safetensors"))
    loud = make_adapter(model, root / "loud", seed=18, r=2, targets=["q_proj"])
    config = json.loads((loud / "adapter_config.json").read_text())
    (loud / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 1e30}))
    deep = make_adapter(model, root / "deep", seed=19, r=2, targets=["q_proj"])
    (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)


def peft_greedy(model, folder: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """PEFT's own generate() with the adapter in ``folder`` (greedy): the oracle."""
    from peft import PeftModel

    device = next(model.parameters()).device  # (a model on the GPU gets its prompt there)
    peft_model = PeftModel.from_pretrained(model, str(folder))
    try:
        with torch.no_grad():
            input_ids = torch.tensor([prompt_ids], device=device)
            out = peft_model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                      max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, len(prompt_ids):].tolist()
    finally:
        peft_model.unload()
