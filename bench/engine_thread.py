"""Decode speed on the thread that runs the model: the main thread, a second thread as it comes, a second
thread that sets torch's thread count first, and one long-lived thread that does so (what
llm_api.service.engine_loop.EngineLoop does: its thread lives as long as the server).

With GNU OpenMP, each thread that enters a parallel region leads its own team, sized from that thread's
own copy of the thread-count setting; a thread started after the main thread used torch may get a team
of one. The served path steps the engine on its own thread, so this measures whether that costs speed.

One process, alternating rounds (this machine's timings swing by 30% between runs; ratios inside one run
hold): each round decodes the same greedy batch on the main thread, on a fresh plain thread, on a fresh
thread that calls torch.set_num_threads(torch.get_num_threads()) first, and on the one thread started
before the first round (which set the thread count once), the order rotated each round; a fresh thread's
one-time costs show as the difference between the last two.

    python bench/engine_thread.py [--rounds 3] [--batch 8] [--tokens 32] [--dtype float32]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time

import torch

from harness.models import model_dir

from llm_api.engine.engine import EngineConfig, LLMEngine
from llm_api.engine.sampling_params import SamplingParams
from llm_api.model.loader import load
from llm_api.model.settings import Settings


def decode_rate(engine: LLMEngine, tokenizer, batch: int, tokens: int, tag: str) -> float:
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    requests = [(f"{tag}-{i}", tokenizer(f"Story {i}: once upon a time")["input_ids"], params, None) for i in range(batch)]
    outputs = engine.generate_batch_stream(requests)
    next(outputs)  # the prefill step (and the first tokens) are not decode
    start, produced = time.perf_counter(), 0
    for step in outputs:
        produced += sum(len(o.new_token_ids) for o in step)
    return produced / (time.perf_counter() - start)


def on_thread(fn, set_threads: bool) -> float:
    result = {}
    num_threads = torch.get_num_threads()

    def run():
        if set_threads:
            torch.set_num_threads(num_threads)
        result["rate"] = fn()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result["rate"]


class LongLivedThread:
    """One thread for the whole run that sets the thread count once, then runs what it is given, like the
    server's engine thread."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        num_threads = torch.get_num_threads()

        def serve() -> None:
            torch.set_num_threads(num_threads)
            while (fn := self._jobs.get()) is not None:
                self._results.put(fn())

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()

    def run(self, fn) -> float:
        self._jobs.put(fn)
        return self._results.get()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    model_path = str(model_dir())
    lm = load(Settings.from_env({"MODEL_PATH": model_path, "DTYPE": args.dtype}))
    engine = LLMEngine(lm.model, EngineConfig(kv_cache_memory_mib=256, max_num_batched_tokens=2048),
                       set(lm.eos_token_ids))
    rates: dict[str, list[float]] = {"main thread": [], "new thread": [], "new thread + set_num_threads": [],
                                     "long-lived thread": []}
    long_lived = LongLivedThread()
    for r in range(args.rounds):
        def run(tag: str, r: int = r) -> float:
            return decode_rate(engine, lm.tokenizer, args.batch, args.tokens, f"{tag}{r}")

        variants = {
            "main thread": lambda: run("m"),
            "new thread": lambda: on_thread(lambda: run("t"), set_threads=False),
            "new thread + set_num_threads": lambda: on_thread(lambda: run("s"), set_threads=True),
            "long-lived thread": lambda: long_lived.run(lambda: run("l")),
        }
        names = list(variants)
        for name in names[r % len(names):] + names[: r % len(names)]:  # each variant leads a round in turn
            rates[name].append(variants[name]())
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items()), flush=True)
    long_lived.close()
    base = statistics.median(rates["main thread"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, batch {args.batch}:")
    for name, values in rates.items():
        print(f"  {name:30s} median {statistics.median(values):6.1f} tok/s  ({statistics.median(values) / base:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
