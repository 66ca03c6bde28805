"""What logprobs and n > 1 cost: the paged engine on the embedded model, alternating rounds in one run.

Two comparisons, each measured in ``--rounds`` alternating rounds (A, B, A, B, ...) so that a shared
machine's swings hit both sides alike:

* **logprobs**: ``--batch`` requests decoding together (prompts of ``--prompt-tokens``, ``ignore_eos``),
  greedy, without logprobs vs with ``logprobs`` = ``--top-logprobs`` on every row (the sampled token's
  logprob and the top alternatives, turned into response text by the service's ``TokenTexts``, as a
  server does). Decode tokens/s over ``--decode-steps`` timed steps after the prefill; issue target:
  logprobs cost at most 10%.
* **n = 4**: one request with ``n`` = 4 (sampled, seeded, ``--new-tokens`` each, ``ignore_eos``) against
  the same request sent four times one after another (n = 1, each started when the previous ended; the
  prefix cache serves their common prompt blocks, as on a server). Output tokens/s over the whole
  request(s), prefill included; issue target: at least 2.5x. Also reports the KV blocks each holds at its
  peak (the n = 4 request holds the prompt's full blocks once). A third side, the same four requests sent
  at once (a batch of four that prefills the prompt four times), shows what a batch of four decodes on
  this machine: n = 4 is that batch with one prefill, so it is the ceiling the hardware sets.

Prints a table; writes JSON (with every round's numbers) to ``--out``. Run it alone on the machine:

    .venv/bin/python bench/sampling_features.py --out bench/results/sampling.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from harness.host import cpu_model
from harness.models import model_dir
from harness.report import markdown_table, write_json


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint folder (default: the embedded model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--top-logprobs", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per choice in the n = 4 comparison")
    parser.add_argument("--n-prompt-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); on a shared "
                        "machine 1 avoids OpenMP oversubscription stalls")
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def load(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir(args.model)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(path)


def prompt_ids(tokenizer, num_tokens: int, salt: int) -> list[int]:
    text = f"Story {salt}: " + "The river ran past the old mill and the children watched the boats go by. " * 200
    return tokenizer(text)["input_ids"][:num_tokens]


def logprobs_round(engine, token_texts, tokenizer, args, with_logprobs: bool, round_index: int) -> float:
    from llm_api.engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=args.decode_steps + 4, ignore_eos=True,
                            logprobs=args.top_logprobs if with_logprobs else None)
    for i in range(args.batch):  # distinct prompts: no prefix-cache shortcut between rounds
        engine.add_request(f"lp{round_index}-{i}", prompt_ids(tokenizer, args.prompt_tokens, round_index * 1000 + i),
                           params)
    while engine.stats().num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                            for r in engine.scheduler.running):
        engine.step()  # prefill (and each row's first token)
    start = time.perf_counter()
    num_tokens = 0
    for _ in range(args.decode_steps):
        for out in engine.step():
            num_tokens += len(out.new_token_ids)
            if out.logprobs:  # what the service does with them: token texts for the response
                for lp in out.logprobs:
                    token_texts.item(lp)
    elapsed = time.perf_counter() - start
    for i in range(args.batch):
        engine.abort_request(f"lp{round_index}-{i}")
    engine.step()
    return num_tokens / elapsed


def run_to_end(engine, requests: list[tuple[str, list[int], object]]) -> tuple[int, int]:
    """Add the requests together and step until all ended -> (output tokens, most KV blocks held at once)."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    num_tokens, peak_blocks = 0, 0
    pool = engine.scheduler.block_pool
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_tokens += len(out.new_token_ids)
        peak_blocks = max(peak_blocks, pool.num_blocks - pool.num_free_blocks)
    return num_tokens, peak_blocks


N_MODES = ("four_sequential", "n4", "four_concurrent")


def n_round(engine, tokenizer, args, mode: str, round_index: int) -> dict:
    """``mode``: "n4" (one request, n = 4), "four_sequential" (the same request four times, one after
    another), or "four_concurrent" (four separate requests at once: a batch of four that prefills the
    prompt four times; what this CPU gives a batch of four, the ceiling for n = 4 bar the shared prefill)."""
    from llm_api.engine.sampling_params import SamplingParams

    prompt = prompt_ids(tokenizer, args.n_prompt_tokens, 50_000 + round_index)  # new per round: cold prefix cache
    params = SamplingParams(max_new_tokens=args.new_tokens, do_sample=True, temperature=1.0, seed=round_index,
                            ignore_eos=True)
    tag = f"{mode}{round_index}"
    start = time.perf_counter()
    if mode == "n4":
        num_tokens, peak = run_to_end(engine, [(tag, prompt, SamplingParams(**{**params.__dict__, "n": 4}))])
    elif mode == "four_concurrent":
        num_tokens, peak = run_to_end(engine, [(f"{tag}-{i}", prompt, params) for i in range(4)])
    else:
        num_tokens, peak = 0, 0
        for i in range(4):
            tokens, blocks = run_to_end(engine, [(f"{tag}-{i}", prompt, params)])
            num_tokens, peak = num_tokens + tokens, max(peak, blocks)
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": num_tokens / elapsed, "seconds": elapsed, "tokens": num_tokens, "peak_blocks": peak}


def main():
    args = parse_args()
    from llm_api.engine.engine import EngineConfig, LLMEngine
    from llm_api.text.logprobs import TokenTexts

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer = load(args)
    engine = LLMEngine(model, EngineConfig(block_size=16, max_num_seqs=max(args.batch, 4), kv_cache_memory_mib=512,
                                           max_num_batched_tokens=2048), {tokenizer.eos_token_id})
    token_texts = TokenTexts(tokenizer)
    logprobs_runs = {"none": [], "logprobs": []}
    n_runs: dict[str, list[dict]] = {mode: [] for mode in N_MODES}
    logprobs_round(engine, token_texts, tokenizer, args, True, -1)  # warm-up
    n_round(engine, tokenizer, args, "n4", -1)
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for with_logprobs in order:
            logprobs_runs["logprobs" if with_logprobs else "none"].append(
                logprobs_round(engine, token_texts, tokenizer, args, with_logprobs, r))
        for mode in (N_MODES if r % 2 == 0 else N_MODES[::-1]):
            n_runs[mode].append(n_round(engine, tokenizer, args, mode, r))
        print(f"round {r}: logprobs none {logprobs_runs['none'][-1]:.1f} tok/s, with {logprobs_runs['logprobs'][-1]:.1f}; "
              + ", ".join(f"{mode} {n_runs[mode][-1]['tokens_per_s']:.1f} tok/s" for mode in N_MODES), flush=True)

    def med(values):
        return statistics.median(values)

    cost = 1 - med(logprobs_runs["logprobs"]) / med(logprobs_runs["none"])
    paired_cost = med([1 - w / n for n, w in zip(logprobs_runs["none"], logprobs_runs["logprobs"])])
    speedup = med([n["tokens_per_s"] / s["tokens_per_s"] for n, s in zip(n_runs["n4"], n_runs["four_sequential"])])
    batch_gain = med([c["tokens_per_s"] / s["tokens_per_s"]
                      for c, s in zip(n_runs["four_concurrent"], n_runs["four_sequential"])])
    result = {
        "machine": {"platform": platform.platform(), "processor": cpu_model(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
        "args": vars(args),
        "logprobs": {**logprobs_runs, "median_cost": cost, "median_paired_cost": paired_cost},
        "n": {**n_runs, "median_speedup": speedup, "median_concurrent_speedup": batch_gain},
    }
    print()
    sequential = med([s["tokens_per_s"] for s in n_runs["four_sequential"]])
    print(markdown_table(("comparison", "A", "B", "B vs A"), [
        (f"decode, batch {args.batch}, greedy (tok/s)", f"no logprobs {med(logprobs_runs['none']):.1f}",
         f"logprobs={args.top_logprobs} {med(logprobs_runs['logprobs']):.1f}", f"cost {paired_cost * 100:.1f}%"),
        (f"{args.new_tokens} tokens x 4 from a {args.n_prompt_tokens}-token prompt (tok/s)",
         f"4 sequential {sequential:.1f}", f"n=4 {med([s['tokens_per_s'] for s in n_runs['n4']]):.1f}",
         f"{speedup:.2f}x"),
        ("the same, as 4 separate requests at once (tok/s)", f"4 sequential {sequential:.1f}",
         f"4 concurrent {med([s['tokens_per_s'] for s in n_runs['four_concurrent']]):.1f}", f"{batch_gain:.2f}x"),
    ], "lrrr"))
    print(f"peak KV blocks: n=4 {n_runs['n4'][0]['peak_blocks']}, 4 concurrent {n_runs['four_concurrent'][0]['peak_blocks']}, "
          f"one of the sequential requests {n_runs['four_sequential'][0]['peak_blocks']}")
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
