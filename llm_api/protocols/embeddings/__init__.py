"""OpenAI's embeddings API (``v1/embeddings``): ``translate`` has the contract."""
