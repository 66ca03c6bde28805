"""The paged-KV-cache engine: continuous batching over stock transformers models."""
