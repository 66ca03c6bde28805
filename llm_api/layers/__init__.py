"""Layer kinds a model's modules can be, below the model loaders and above the kernels: linear layers and
embeddings whose weights stay in GGUF's block formats (``quantized``)."""
