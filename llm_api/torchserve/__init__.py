"""The TorchServe edge: ``handler.LLMHandler`` (the archive's handler), the per-request I/O on TorchServe's
context (``reply``) and the metric sink (``metrics_sink``). The only package that imports ``ts``."""
