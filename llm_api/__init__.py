"""llm_api: a TorchServe handler suite that streams tokens from Hugging Face causal language models."""

__version__ = "0.1.0"
