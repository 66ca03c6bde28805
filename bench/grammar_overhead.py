"""Cost of structured output (llm_api.structured, xgrammar) on this machine, in one run.

(a) compile: each schema compiled cold (cache cleared) in several rounds, then once more from the cache;
    also json_object, a regex and an EBNF grammar, and building the compiler (once per model).
(b) the sampling step of a [16, V] float32 logits batch with 8 rows under grammars (a mix of the schemas,
    each row a random walk that restarts when its grammar ends): fill the 8 masks + apply them + argmax +
    accept the 8 tokens, against the same step without masks (argmax alone, the greedy sampler).
    Alternating rounds: the ratio is taken within each round, then the median over rounds (the machine
    is shared; absolute numbers swing, ratios much less).
(c) the same step with the embedded model's logits width, in the dtype the server runs it (bf16), and
    an empty ``rows`` (every row unconstrained) to show it costs nothing; with a reference forward of the
    embedded model (16 rows x 1 token) to put the step in proportion.
(d) GIL: how fast a Python thread runs while another thread compiles, against a GIL-free reference
    (sha256) and a GIL-holding one (a Python loop).
  python bench/grammar_overhead.py --rounds 5 --steps 40 --out /tmp/grammar_overhead.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import torch
from harness.host import cpu_model
from harness.models import model_dir

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        },
        "required": ["name", "age", "color", "tags"],
    },
    "invoice": {
        "type": "object",
        "properties": {
            "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
            "date": {"type": "string", "format": "date"},
            "vendor": {"type": "object", "properties": {
                "name": {"type": "string"},
                "address": {"type": "object", "properties": {
                    "street": {"type": "string"}, "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"]}},
                "required": ["name", "address"]},
            "line_items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
                "description": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
                "unit_price": {"type": "number", "minimum": 0}},
                "required": ["description", "quantity", "unit_price"]}},
            "total": {"type": "number"},
            "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]},
        },
        "required": ["invoice_number", "date", "vendor", "line_items", "total", "currency"],
    },
    "calendar (maxLength 80)": {
        "type": "object",
        "$defs": {
            "person": {"type": "object", "properties": {"name": {"type": "string"},
                                                        "email": {"type": "string", "format": "email"}},
                       "required": ["name", "email"]},
            "event": {"type": "object", "properties": {
                "title": {"type": "string", "maxLength": 80},
                "start": {"type": "string", "format": "date-time"},
                "end": {"type": "string", "format": "date-time"},
                "location": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "attendees": {"type": "array", "items": {"$ref": "#/$defs/person"}},
                "recurring": {"type": "boolean"}},
                "required": ["title", "start", "end", "attendees"]},
        },
        "properties": {"events": {"type": "array", "items": {"$ref": "#/$defs/event"}}},
        "required": ["events"],
    },
    "issue (12 optional)": {
        "type": "object",
        "properties": {
            "title": {"type": "string"}, "body": {"type": "string"},
            "labels": {"type": "array", "items": {"type": "string"}},
            "assignees": {"type": "array", "items": {"type": "string"}},
            "state": {"enum": ["open", "closed"]}, "milestone": {"type": ["integer", "null"]},
            "priority": {"type": "integer", "minimum": 1, "maximum": 5},
            "estimate_hours": {"type": "number"}, "blocked": {"type": "boolean"},
            "component": {"enum": ["api", "engine", "kernels", "docs", "ci"]},
            "reporter": {"type": "string"}, "due": {"type": "string", "format": "date"},
        },
        "additionalProperties": False,
    },
}
REGEX = r"[0-9]{3}-[a-z]+"
EBNF = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [A-Z] [a-z]{1,8}\n'


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint folder (default: the embedded model)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant per round")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--constrained", type=int, default=8)
    parser.add_argument("--bench-vocab", type=int, default=49152, help="logits width of (b)")
    parser.add_argument("--no-model-forward", action="store_true", help="skip the reference forward in (c)")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch.set_num_threads (0: leave torch's default; 1 keeps a loaded small machine from "
                             "oversubscribing its cores)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser.parse_args()


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f}"


# ----------------------------------------------------------------- (a) compile


def bench_compile(compiler, rounds):
    from llm_api.structured.spec import GrammarSpec

    specs = {name: GrammarSpec.json_schema(schema) for name, schema in SCHEMAS.items()}
    specs |= {"json_object": GrammarSpec.json_object(), "regex": GrammarSpec.regex(REGEX),
              "ebnf": GrammarSpec.ebnf(EBNF)}
    cold = {name: [] for name in specs}
    memory = {}
    for _ in range(rounds):
        for name, spec in specs.items():  # every schema once per round: alternating
            compiler.clear_cache()
            compiled = compiler.compile(spec)
            cold[name].append(compiled.compile_seconds)
            memory[name] = compiled.memory_bytes
    cached = {}
    for name, spec in specs.items():
        compiler.compile(spec)
        start = time.perf_counter()
        for _ in range(100):
            compiler.compile(spec)
        cached[name] = (time.perf_counter() - start) / 100
    return {name: {"cold_min_s": min(cold[name]), "cold_median_s": statistics.median(cold[name]),
                   "cached_s": cached[name], "memory_bytes": memory[name]} for name in specs}


# ----------------------------------------------------------------- (b), (c) the sampling step


class Walkers:
    """``n`` matchers over a mix of the schemas, each restarted when its grammar ends."""

    def __init__(self, compiler, n):
        from llm_api.structured.matcher import GrammarMatcher
        from llm_api.structured.spec import GrammarSpec

        self._make = GrammarMatcher
        self.grammars = [compiler.compile(GrammarSpec.json_schema(s)) for s in SCHEMAS.values()]
        self.matchers = [GrammarMatcher(self.grammars[i % len(self.grammars)]) for i in range(n)]
        self.num_restarts = 0

    def restart_finished(self):
        for i, matcher in enumerate(self.matchers):
            if matcher.is_terminated():
                self.matchers[i] = self._make(matcher.grammar)
                self.num_restarts += 1


def bench_step(compiler, vocab_size, dtype, args, stop_ids):
    from llm_api.structured.bitmask import allocate_bitmask, apply_bitmask
    from llm_api.structured.matcher import fill_bitmasks

    batch, n = args.batch, args.constrained
    rows = list(range(0, batch, max(1, batch // n)))[:n]  # constrained rows spread over the batch
    walkers = Walkers(compiler, n)
    generator = torch.Generator().manual_seed(0)
    pool = [torch.randn(batch, vocab_size, generator=generator).to(dtype) for _ in range(8)]
    # Let the walks end: stop tokens get a lift (only where the grammar allows them at all).
    for logits in pool:
        logits[:, list(stop_ids)] += 6.0
    work = torch.empty_like(pool[0])
    bitmask = allocate_bitmask(batch, vocab_size)

    def plain(i):
        work.copy_(pool[i % len(pool)])
        start = time.perf_counter()
        work.argmax(dim=-1).tolist()
        return {"total": time.perf_counter() - start}

    def masked(i, use_rows=True):
        walkers.restart_finished()
        work.copy_(pool[i % len(pool)])
        t0 = time.perf_counter()
        if use_rows:
            fill_bitmasks(walkers.matchers, bitmask, rows)
        t1 = time.perf_counter()
        apply_bitmask(work, bitmask, rows if use_rows else [])
        t2 = time.perf_counter()
        token_ids = work.argmax(dim=-1).tolist()
        t3 = time.perf_counter()
        if use_rows:
            for matcher, row in zip(walkers.matchers, rows):
                assert matcher.accept_token(token_ids[row])
        t4 = time.perf_counter()
        return {"total": t4 - t0, "fill": t1 - t0, "apply": t2 - t1, "argmax": t3 - t2, "accept": t4 - t3}

    variants = {"plain": plain, "masked": masked, "no rows": lambda i: masked(i, use_rows=False)}
    for fn in variants.values():  # warm-up
        for i in range(3):
            fn(i)
    samples = {name: [] for name in variants}
    ratios = []
    step = 0
    for _ in range(args.rounds):
        medians = {}
        for name, fn in variants.items():
            round_samples = [fn(step + i) for i in range(args.steps)]
            step += args.steps
            samples[name] += round_samples
            medians[name] = statistics.median(s["total"] for s in round_samples)
        ratios.append(medians["masked"] / medians["plain"])
    result = {"vocab_size": vocab_size, "dtype": str(dtype).replace("torch.", ""), "rows": rows,
              "ratio_median": statistics.median(ratios), "ratios": ratios, "num_restarts": walkers.num_restarts}
    for name, rs in samples.items():
        for phase in rs[0]:
            result[f"{name}.{phase}_median_s"] = statistics.median(s[phase] for s in rs)
    return result


def bench_batch_fill(compiler, vocab_size, args):
    """Per-matcher loop vs xgrammar's threaded BatchGrammarMatcher for the same 8 fills."""
    import xgrammar

    from llm_api.structured.bitmask import allocate_bitmask, apply_bitmask
    from llm_api.structured.matcher import fill_bitmasks

    walkers = Walkers(compiler, args.constrained)
    # Advance each walker a few tokens in, so the states are mixed (in strings, between keys...).
    bitmask = allocate_bitmask(args.batch, vocab_size)
    generator = torch.Generator().manual_seed(1)
    rows = list(range(args.constrained))
    for _ in range(12):
        walkers.restart_finished()
        fill_bitmasks(walkers.matchers, bitmask, rows)
        logits = torch.randn(args.batch, vocab_size, generator=generator)
        apply_bitmask(logits, bitmask, rows)
        for matcher, token_id in zip(walkers.matchers, logits.argmax(-1).tolist()):
            matcher.accept_token(token_id)
    walkers.restart_finished()
    handles = [m._matcher for m in walkers.matchers]
    batchers = {f"BatchGrammarMatcher({t})": xgrammar.BatchGrammarMatcher(max_threads=t) for t in (1, 2)}
    variants = {"loop": lambda: fill_bitmasks(walkers.matchers, bitmask, rows)}
    variants |= {name: (lambda b=b: b.batch_fill_next_token_bitmask(handles, bitmask, rows))
                 for name, b in batchers.items()}
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            for _ in range(args.steps):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_model_forward(model_path, batch, rounds):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (batch, 1))
    times = []
    with torch.inference_mode():
        model(input_ids, use_cache=False)
        for _ in range(rounds * 2):
            start = time.perf_counter()
            model(input_ids, use_cache=False)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


# ----------------------------------------------------------------- (d) GIL


def bench_gil(compiler, rounds):
    """How fast a Python counting thread runs while the main thread runs a workload, relative to an
    equally long sleep right after. Near the GIL-free reference (sha256): the workload releases the GIL;
    near 0 (like ``sum(range(n))``, one C call that never lets go): it holds it."""
    from llm_api.structured.spec import GrammarSpec

    data = os.urandom(64 << 20)
    counter = [0]

    def compile_cold():
        counter[0] += 1
        compiler.clear_cache()
        compiler.compile(GrammarSpec.json_schema({**SCHEMAS["invoice"], "title": f"gil-{counter[0]}"}))

    workloads = {"sha256 (releases the GIL)": lambda: hashlib.sha256(data).digest(),
                 "sum(range) (holds the GIL)": lambda: sum(range(3_000_000)),
                 "xgrammar compile (invoice)": compile_cold}
    count, stop = [0], [False]

    def spin():
        while not stop[0]:
            count[0] += 1

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    time.sleep(0.1)
    results = {name: [] for name in workloads}
    try:
        for _ in range(rounds):
            for name, work in workloads.items():
                c0, t0 = count[0], time.perf_counter()
                work()
                c1, t1 = count[0], time.perf_counter()
                time.sleep(t1 - t0)
                c2, t2 = count[0], time.perf_counter()
                results[name].append(((c1 - c0) / (t1 - t0)) / max((c2 - c1) / (t2 - t1), 1e-9))
    finally:
        stop[0] = True
        spinner.join()
    return {name: statistics.median(rs) for name, rs in results.items()}


# ----------------------------------------------------------------- main


def main():
    args = parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    from importlib.metadata import version

    from transformers import AutoConfig, AutoTokenizer

    from llm_api.structured.compiler import GrammarCompiler

    model_path = model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model_vocab = AutoConfig.from_pretrained(model_path).vocab_size
    stop_ids = [tokenizer.eos_token_id]
    load_start = os.getloadavg()
    machine = (f"{platform.machine()} {cpu_model()} {os.cpu_count()} cores, torch {torch.__version__} "
               f"({torch.get_num_threads()} threads), xgrammar {version('xgrammar')}, "
               f"python {platform.python_version()}")
    print(machine)

    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, args.bench_vocab, stop_ids)
    build_s = time.perf_counter() - start
    print(f"\nGrammarCompiler for {model_path.name} (V={args.bench_vocab}): built in {build_s:.2f} s "
          f"(once per model); compile threads: xgrammar spawns num_threads per compilation")

    compile_results = bench_compile(compiler, args.rounds)
    print(f"\n(a) compile, {args.rounds} cold rounds (min / median), then from the cache")
    print(f"{'spec':22s} {'cold min ms':>12s} {'cold med ms':>12s} {'cached us':>10s} {'memory MiB':>11s}")
    for name, r in compile_results.items():
        print(f"{name:22s} {ms(r['cold_min_s']):>12s} {ms(r['cold_median_s']):>12s} {r['cached_s'] * 1e6:10.1f} "
              f"{r['memory_bytes'] / 2**20:11.2f}")

    steps = {"(b) f32": bench_step(compiler, args.bench_vocab, torch.float32, args, stop_ids)}
    model_compiler = compiler if model_vocab == args.bench_vocab else GrammarCompiler(tokenizer, model_vocab, stop_ids)
    steps["(c) bf16, model V"] = bench_step(model_compiler, model_vocab, torch.bfloat16, args, stop_ids)
    print(f"\n(b)/(c) sampling step, logits [{args.batch}, V], {args.constrained} rows under grammars; "
          f"medians over {args.rounds} alternating rounds x {args.steps} steps (ms)")
    print(f"{'variant':20s} {'V':>6s} {'plain':>8s} {'masked':>8s} {'fill':>8s} {'apply':>8s} {'argmax':>8s} "
          f"{'accept':>8s} {'ratio':>6s} {'no rows':>8s}")
    for name, r in steps.items():
        print(f"{name:20s} {r['vocab_size']:6d} {ms(r['plain.total_median_s'])} {ms(r['masked.total_median_s'])} "
              f"{ms(r['masked.fill_median_s'])} {ms(r['masked.apply_median_s'])} {ms(r['masked.argmax_median_s'])} "
              f"{ms(r['masked.accept_median_s'])} {r['ratio_median']:6.2f} {ms(r['no rows.total_median_s'])}")
    print("  plain: argmax alone (the greedy sampler); masked: fill 8 masks + apply + argmax + accept 8 tokens; "
          "ratio: masked / plain, per round, median;\n  no rows: the masked path with every row unconstrained "
          f"(rows=[]). Walks restarted {sum(r['num_restarts'] for r in steps.values())} times (grammars completed).")

    batch_fill = bench_batch_fill(compiler, args.bench_vocab, args)
    print(f"\nfill of {args.constrained} masks (median ms): "
          + ", ".join(f"{name} {t * 1e3:.3f}" for name, t in batch_fill.items()))

    forward_s = None
    if not args.no_model_forward:
        forward_s = bench_model_forward(model_path, args.batch, args.rounds)
        step_c = steps["(c) bf16, model V"]
        added_s = step_c["masked.total_median_s"] - step_c["plain.total_median_s"]
        print(f"reference: {model_path.name} bf16 forward of {args.batch} rows x 1 token (no KV cache) "
              f"{forward_s * 1e3:.1f} ms; the masked step adds {added_s / forward_s * 100:.1f}% of it")

    gil = bench_gil(compiler, args.rounds)
    print("\n(d) a Python thread's speed while the main thread runs X, relative to while it sleeps")
    for name, ratio in gil.items():
        print(f"  {name:30s} {ratio:5.2f}")
    load_end = os.getloadavg()
    print(f"\nload average at start {load_start[0]:.2f}, at end {load_end[0]:.2f} ({os.cpu_count()} cores)")

    if args.out:
        Path(args.out).write_text(json.dumps({
            "machine": machine, "load_average": [load_start[0], load_end[0]], "compiler_build_s": build_s,
            "compile": compile_results, "step": steps, "batch_fill_s": batch_fill,
            "model_forward_s": forward_s, "gil_progress": gil}, indent=2))


if __name__ == "__main__":
    main()
