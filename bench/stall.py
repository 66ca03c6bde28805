"""Head-of-line stalls: how long running streams wait between tokens while heavy requests arrive.

Starts a real TorchServe with the shipped settings (async mode; MAX_NUM_BATCHED_TOKENS sized to this
machine unless --budgets names others), opens running streams, and while they generate sends:

  long-prompt   one prompt of MAX_INPUT_TOKENS tokens (the longest a request may bring);
  huge-text     two 6.4 MB `text` bodies and two 6.4 MB chat messages (refused: over MAX_INPUT_TOKENS);
  embeds        four concurrent `inputs_embeds` as large as max_request_size lets a body be.

For each phase it reports the running streams' inter-token gaps (chunk arrival times, measured by the
client) inside the phase's window, the latency of `GET .../v1/health` polled every 50 ms, and how long
the heavy requests took. Usage:

    python bench/stall.py                     # the shipped default budget
    python bench/stall.py --budgets 0,2048    # also the old fixed 2,048-token step, for comparison
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp
import torch
from harness.host import cpu_model
from harness.models import model_dir
from harness.torchserve_server import REPO, TorchServe

NUM_STREAMS = 4
HIDDEN_SIZE = 576
MAX_REQUEST_BYTES = 6_553_500


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Streams:
    """Running streams that record when each chunk arrived."""

    def __init__(self, session, url, headers):
        self.session, self.url, self.headers = session, url, headers
        self.arrivals: list[list[float]] = []
        self.tasks: list[asyncio.Task] = []

    async def _one(self, index: int) -> None:
        times = self.arrivals[index]
        payload = {"text": f"Story number {index}: once upon a time", "max_new_tokens": 2000, "ignore_eos": True}
        async with self.session.post(self.url, json=payload, headers=self.headers) as resp:
            async for _ in resp.content.iter_any():
                times.append(time.monotonic())

    def start(self, n: int) -> None:
        for i in range(n):
            self.arrivals.append([])
            self.tasks.append(asyncio.create_task(self._one(i)))

    def gaps_between(self, start: float, end: float) -> list[float]:
        gaps = []
        for times in self.arrivals:
            inside = [t for t in times if start <= t <= end]
            before = [t for t in times if t < start]
            if before:
                inside = [before[-1]] + inside
            gaps += [b - a for a, b in zip(inside, inside[1:])]
            after = [t for t in times if t > end]
            if inside and not after:  # a stream that went silent until the window's end counts that wait
                gaps.append(end - inside[-1])
        return gaps

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def poll_health(session, url, headers, stop: asyncio.Event, latencies: list[float]) -> None:
    while not stop.is_set():
        start = time.monotonic()
        async with session.get(url, headers=headers) as resp:
            await resp.read()
        latencies.append(time.monotonic() - start)
        await asyncio.sleep(0.05)


async def timed_post(session, url, headers, payload: bytes) -> tuple[int, float]:
    start = time.monotonic()
    async with session.post(url, data=payload, headers={**headers, "Content-Type": "application/json"}) as resp:
        await resp.read()
        return resp.status, time.monotonic() - start


def long_prompt(tokenizer, num_tokens: int) -> str:
    words = "The river bends past the old mill where the children play and the dogs bark at the moon. "
    text = words * (num_tokens // 15 + 20)
    ids = tokenizer(text)["input_ids"][: num_tokens - 2]
    return tokenizer.decode(ids)


def embeds_body(max_bytes: int) -> bytes:
    row = json.dumps([0.0123] * HIDDEN_SIZE)
    rows = max(1, (max_bytes - 200) // (len(row) + 2))
    return json.dumps({"inputs_embeds": [[0.0123] * HIDDEN_SIZE] * min(rows, 2048), "max_new_tokens": 4}).encode()


async def run_phases(server: TorchServe, tokenizer, max_input_tokens: int) -> dict:
    url = f"{server.http}/predictions/{server.model_name}"
    health_url = f"{url}/1.0/v1/health"
    headers = {"Authorization": f"Bearer {server.key()}"}
    results = {}
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        streams = Streams(session, url, headers)
        streams.start(NUM_STREAMS)
        while min(len(t) for t in streams.arrivals) < 10:  # all flowing
            await asyncio.sleep(0.1)
        heavy = {
            "long-prompt": [json.dumps({"text": long_prompt(tokenizer, max_input_tokens), "max_new_tokens": 8}).encode()],
            "huge-text": [json.dumps({"text": "word " * 1_300_000}).encode()] * 2
            + [json.dumps({"messages": [{"role": "user", "content": "word " * 1_300_000}]}).encode()] * 2,
            "embeds": [embeds_body(MAX_REQUEST_BYTES)] * 4,
        }
        for phase, bodies in heavy.items():
            await asyncio.sleep(1.0)
            stop, latencies = asyncio.Event(), list[float]()
            poller = asyncio.create_task(poll_health(session, health_url, headers, stop, latencies))
            start = time.monotonic()
            outcomes = await asyncio.gather(*(timed_post(session, url, headers, b) for b in bodies))
            end = time.monotonic() + 1.0
            await asyncio.sleep(1.0)
            stop.set()
            await poller
            gaps = streams.gaps_between(start, end)
            results[phase] = {
                "requests": [{"status": s, "seconds": round(t, 2)} for s, t in outcomes],
                "body_mib": round(len(bodies[0]) / 2**20, 2),
                "stream_gap_p50_s": round(quantile(gaps, 0.5), 3), "stream_gap_p99_s": round(quantile(gaps, 0.99), 3),
                "stream_gap_max_s": round(max(gaps, default=float("nan")), 3), "num_gaps": len(gaps),
                "health_p99_ms": round(quantile(latencies, 0.99) * 1e3, 1),
                "health_max_ms": round(max(latencies, default=float("nan")) * 1e3, 1), "num_health": len(latencies),
            }
            print(phase, json.dumps(results[phase]), flush=True)
        await streams.stop()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="0", help="MAX_NUM_BATCHED_TOKENS values to run (0: sized to the device)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model_path = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    report: dict = {"date": datetime.date.today().isoformat(), "machine": f"{cpu_model()}, {os.cpu_count()} cores",
              "torch": torch.__version__, "runs": {}}
    for budget in args.budgets.split(","):
        env = {"MODEL_PATH": str(model_path), "MAX_NUM_BATCHED_TOKENS": budget, "KV_CACHE_MEMORY_MIB": "256"}
        with tempfile.TemporaryDirectory(prefix="llm-stall-") as work:
            server = TorchServe(Path(work), model_config=(REPO / "model-config.yaml").read_text(), env=env)
            try:
                server.start()
                line = server.wait_for_log_lines("paged engine:")[0]
                print(f"budget {budget}: {line.split('MODEL_LOG - ')[-1]}", flush=True)
                results = asyncio.run(run_phases(server, tokenizer, 2048))
                report["runs"][budget] = {"engine": line.split("MODEL_LOG - ")[-1], **results}
            finally:
                server.stop()
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
