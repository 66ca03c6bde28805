"""Stream an answer over gRPC (StreamPredictions with stream=true), then one unary call.

Usage (with `make serve` running, from the repo root so key_file.json is found; or LLM_API_KEY set to the
key of `llm_api serve`, with LLM_API_HTTP=http://127.0.0.1:8000 / LLM_API_GRPC=127.0.0.1:50051):
    .venv/bin/python examples/grpc_stream.py "Once upon a time"
"""

import os
import sys

from llm_api.client import GRPCClient, read_key

prompt = sys.argv[1] if len(sys.argv) > 1 else "Once upon a time"
KEY = os.environ.get("LLM_API_KEY") or read_key("key_file.json")
with GRPCClient(os.environ.get("LLM_API_GRPC", "127.0.0.1:7070"), os.environ.get("MODEL_NAME", "smollm2"), key=KEY) as client:
    for text in client.stream({"text": prompt, "max_new_tokens": "64"}):
        print(text, end="", flush=True)
    print()
    print("unary:", client.generate({"text": prompt, "max_new_tokens": "16"}))
