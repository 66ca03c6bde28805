"""Stream an answer over HTTP with the package's client.

Usage (with `make serve` running, from the repo root so key_file.json is found; or LLM_API_KEY set to the
key of `llm_api serve`, with LLM_API_HTTP=http://127.0.0.1:8000 / LLM_API_GRPC=127.0.0.1:50051):
    .venv/bin/python examples/http_stream.py "What is the capital of France?"
"""

import os
import sys

from llm_api.client import HTTPClient, read_key

question = sys.argv[1] if len(sys.argv) > 1 else "What is the capital of France?"
KEY = os.environ.get("LLM_API_KEY") or read_key("key_file.json")
client = HTTPClient(os.environ.get("LLM_API_HTTP", "http://127.0.0.1:8080"), os.environ.get("MODEL_NAME", "smollm2"), key=KEY)
for text in client.stream({"messages": [{"role": "user", "content": question}], "max_new_tokens": 128}):
    print(text, end="", flush=True)
print()
