"""The model layer: settings from the environment, loading (dtype, device map, quantization), the embedded
default model, and device placement helpers. Imports nothing from the layers above it."""
