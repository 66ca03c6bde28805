"""Soak: many concurrent streams with mixed prompts and parameters against a real TorchServe.

``run_load(server, seconds, clients)`` is what tests/test_reliability.py runs for a minute; run this
file for longer. Every request must end with exactly one end-of-stream marker or a clear error (only
deadline errors are expected: some requests ask for a short ``timeout``; one whose deadline passes before
its first token gets a 408 answer instead of a stream), none may outlive its deadline,
and greedy answers must equal the prompt's solo answer (no mixing between requests). Afterwards every
KV block must be free and no request left in the service's tables (read from the server's log line).

    .venv/bin/python bench/soak.py --minutes 10 --clients 32
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

MARKER = "<|endoftext|>"
PROMPTS = [
    "The history of the Roman empire",
    "A recipe for bread:",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "The capital of Japan is",
    "List of planets in the solar system:",
    "Photosynthesis is the process",
]
GREEDY = [{"text": p, "max_new_tokens": 16 + 8 * (i % 4)} for i, p in enumerate(PROMPTS)]
VARIANTS = [
    lambda i: dict(GREEDY[i % len(GREEDY)]),
    lambda i: {"text": PROMPTS[i % 8], "max_new_tokens": 24, "temperature": 0.9, "top_p": 0.9, "seed": i},
    lambda i: {"messages": [{"role": "user", "content": PROMPTS[i % 8]}], "max_new_tokens": 32, "stop": ["."]},
    lambda i: {"text": PROMPTS[i % 8], "max_new_tokens": 200, "ignore_eos": True, "timeout": 2},
]


@dataclass
class LoadReport:
    requests: int
    completed: int  # ended with the marker
    deadline_errors: int  # ended with a timeout error, as asked
    problems: list[str]  # anything else: lost requests
    seconds: float
    clients: int


def _prediction_request(server, payload) -> urllib.request.Request:
    return urllib.request.Request(
        f"{server.http}/predictions/{server.model_name}", data=json.dumps(payload).encode(),
        headers={"Authorization": f"Bearer {server.key()}", "Content-Type": "application/json"},
    )


def post(server, payload, timeout=300):
    """-> (status, body text, seconds)."""
    req = _prediction_request(server, payload)
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(), time.monotonic() - t0
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), time.monotonic() - t0


def usage_after_one_more_request(server) -> tuple[int, int, int]:
    """(free KV blocks, total, live requests) logged at the end of a request sent once all others ended:
    its own line, found by its x-request-id (TorchServe's model log lags the answers, so a line of the
    load may still arrive after this request's answer)."""
    with urllib.request.urlopen(_prediction_request(server, {"text": "done", "max_new_tokens": 1}),
                                timeout=300) as resp:
        request_id = resp.headers["x-request-id"]
        resp.read()
    lines = server.wait_for_log_lines(f"request {request_id} ended", timeout=30)
    assert lines, f"no end line for request {request_id}"
    line = lines[-1]
    match = re.search(r"KV blocks free (\d+)/(\d+); live requests (\d+)", line)
    assert match, f"no KV blocks in the end line: {line}"
    free, total, live = map(int, match.groups())
    return free, total, live


def run_load(server, seconds: float, clients: int = 32) -> LoadReport:
    solo = {}
    for payload in GREEDY:
        status, body, _ = post(server, payload)
        if status != 200 or not body.endswith(MARKER):
            raise RuntimeError(f"solo request failed: {status} {body[-200:]!r}")
        solo[payload["text"]] = body
    records, lock = [], threading.Lock()
    deadline = time.monotonic() + seconds

    def client(worker: int):
        i = worker
        while time.monotonic() < deadline:
            payload = VARIANTS[i % len(VARIANTS)](i)
            try:
                result = post(server, payload)
            except OSError as exc:
                result = (None, repr(exc), 0.0)
            with lock:
                records.append((payload, *result))
            i += clients

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(w,), daemon=True) for w in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 600)
    problems = [f"client {i} hung" for i, t in enumerate(threads) if t.is_alive()]
    completed = deadline_errors = 0
    for payload, status, body, took in records:
        if status == 408 and "timeout" in payload and _error_type(body) == "timeout":
            deadline_errors += 1  # its deadline passed before its first token: a 408 head instead of a stream
        elif status != 200 or body.count(MARKER) > 1:
            problems.append(f"{status} {body[-200:]!r} for {payload}")
        elif not body.endswith(MARKER):
            error = json.loads(body.strip().splitlines()[-1])
            if error.get("type") == "timeout" and "timeout" in payload:
                deadline_errors += 1
            else:
                problems.append(f"unexpected error {error} for {payload}")
        elif payload in GREEDY and body != solo[payload["text"]]:
            problems.append(f"greedy answer differs from its solo answer for {payload['text']!r}")
        else:
            completed += 1
        if "timeout" in payload and took > payload["timeout"] + 30:
            problems.append(f"outlived its deadline by {took - payload['timeout']:.1f}s")
    return LoadReport(len(records), completed, deadline_errors, problems, time.monotonic() - t0, clients)


def _error_type(body: str) -> str | None:
    try:
        return json.loads(body).get("type")
    except (ValueError, AttributeError):
        return None


def main() -> int:
    from harness.models import model_dir
    from harness.torchserve_server import REPO, TorchServe

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--model", default=None, help="HF checkpoint folder (default: $MODEL_PATH, else the embedded model)")
    args = parser.parse_args()
    args.model = str(model_dir(args.model))
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        server = TorchServe(Path(tmp), model_config=(REPO / "model-config.yaml").read_text(),
                            env={"MODEL_PATH": args.model, "DTYPE": "float32"})
        try:
            server.start()
            report = run_load(server, args.minutes * 60, args.clients)
            free, total, live = usage_after_one_more_request(server)
        finally:
            server.stop()
    print(f"{report.clients} streams x {report.seconds / 60:.1f} min: {report.requests} requests, "
          f"{report.completed} completed, {report.deadline_errors} ended by their deadline (as asked), "
          f"{len(report.problems)} lost; KV blocks free {free}/{total}, live requests {live}")
    for problem in report.problems[:20]:
        print("  ", problem)
    return 0 if not report.problems and free == total and live == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
