"""Runtime LoRA adapter loading (vLLM's ``v1/load_lora_adapter`` / ``v1/unload_lora_adapter``)."""
