"""Continuing a conversation with ``previous_response_id``: the second turn's time to first token against the
first turn's, and against sending the whole history again with nothing cached.

Against a running `llm_api serve` (``--url``, ``--key``) or one this script starts on the embedded model
(float32, its own port). Each round, with a fresh nonce at the start of the conversation so no round
reuses another's blocks:

  first   ``responses.create`` of a ~``--prompt-tokens`` user message (streamed), TTFT measured;
  second  ``previous_response_id`` = first, a short follow-up question: its prompt is the first turn's
          prompt and answer (their blocks are in the prefix cache) plus the new turn;
  cold    the same conversation as the second turn's (the first message, the first answer, the follow-up)
          sent whole with another nonce, so nothing of it is cached: what a client without the store pays.

TTFT is the time from sending to the first ``response.output_text.delta``. Prints medians and the ratios
second/first (the issue's target: at most 1.3) and cold/second; writes JSON with every round to --out.

    .venv/bin/python bench/responses_chain.py --rounds 5 --out /tmp/responses_chain.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import openai
from harness.host import cpu_model

MODEL = "smollm2"
TEXT = ("The river town kept its old customs. Every spring the ferrymen painted their boats, the bakers "
        "competed for the best rye loaf, and the children raced paper ships from the mill to the bridge. ")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an llm_api serve base URL (…/v1); default: start one here")
    parser.add_argument("--key", default="bench-key-1234")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


def ttft(client, **kwargs) -> tuple[float, str, str]:
    """(seconds to the first text delta, the response id, the whole text) of one streamed create."""
    start = time.perf_counter()
    first = None
    response_id, text = "", []
    for event in client.responses.create(model=MODEL, stream=True, temperature=0, max_output_tokens=16, **kwargs):
        if event.type == "response.output_text.delta":
            first = first or time.perf_counter() - start
            text.append(event.delta)
        elif event.type == "response.created":
            response_id = event.response.id
    assert first is not None, "no text came"
    return first, response_id, "".join(text)


def start_server(key: str) -> tuple[subprocess.Popen, str]:
    from harness.models import model_dir
    from harness.server_process import free_ports

    port = free_ports(1)[0]
    env = {**os.environ, "MODEL_PATH": str(model_dir()), "DTYPE": "float32",
           "LLM_API_KEY": key, "TMPDIR": tempfile.mkdtemp()}
    process = subprocess.Popen([sys.executable, "-m", "llm_api.server", "serve", "--port", str(port),
                                "--grpc-port", "0"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            client.models.list()
            return process, f"http://127.0.0.1:{port}/v1"
        except (openai.APIConnectionError, openai.InternalServerError, openai.APIStatusError):
            time.sleep(1)
    process.kill()
    raise RuntimeError("the server did not start")


def main():
    args = parse_args()
    process, url = (None, args.url) if args.url else start_server(args.key)
    try:
        client = openai.OpenAI(base_url=url, api_key=args.key, max_retries=0, timeout=600)
        story = TEXT * max(1, args.prompt_tokens // 40)  # (~40 tokens per repetition)
        question = "In one sentence: what do the children race?"
        rounds = []
        for r in range(args.rounds + 1):  # (round 0 warms up and is not counted)
            message = f"[{uuid.uuid4().hex}] {story}\nSummarize this in one sentence."
            first_s, first_id, first_text = ttft(client, input=message)
            second_s, _, _ = ttft(client, previous_response_id=first_id, input=question)
            history = [{"role": "user", "content": f"[{uuid.uuid4().hex}] {story}\nSummarize this in one sentence."},
                       {"role": "assistant", "content": first_text}, {"role": "user", "content": question}]
            cold_s, _, _ = ttft(client, input=history, store=False)
            if r:
                rounds.append({"first_s": first_s, "second_s": second_s, "cold_s": cold_s})
                print(f"round {r}: first {first_s * 1000:.0f} ms, second {second_s * 1000:.0f} ms, "
                      f"cold {cold_s * 1000:.0f} ms", flush=True)
        med = {k: statistics.median(x[k] for x in rounds) for k in ("first_s", "second_s", "cold_s")}
        ratio_first = statistics.median(x["second_s"] / x["first_s"] for x in rounds)
        ratio_cold = statistics.median(x["cold_s"] / x["second_s"] for x in rounds)
        print(f"median TTFT: first turn {med['first_s'] * 1000:.0f} ms, second turn (previous_response_id) "
              f"{med['second_s'] * 1000:.0f} ms, whole history uncached {med['cold_s'] * 1000:.0f} ms")
        print(f"second/first {ratio_first:.2f}x (target <= 1.3x); uncached/second {ratio_cold:.2f}x")
        if args.out:
            args.out.write_text(json.dumps({"rounds": rounds, "median": med, "second_over_first": ratio_first,
                                            "cold_over_second": ratio_cold, "prompt_tokens": args.prompt_tokens,
                                            "machine": cpu_model()}, indent=2))
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)


if __name__ == "__main__":
    main()
