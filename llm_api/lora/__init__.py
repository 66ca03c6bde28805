"""LoRA adapters served beside one base model: many PEFT fine-tunes mixed in one batch (docs/lora.md).

``config`` reads and checks PEFT adapter folders, ``registry`` keeps the loaded adapters and the
MAX_LORAS resident slots (host copies swapped in on demand), ``context`` carries one step's per-row slot
indices to the wrapped modules, ``layer`` wraps the model's target linears and ``ops`` computes the
per-row delta, grouped by adapter.
"""
