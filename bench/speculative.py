"""Speculative decoding (n-gram prompt lookup) on vs off: tokens/s, acceptance rate, time to first token.

Workloads, each run with SPECULATIVE_TOKENS=k and with speculation off, in alternating rounds (the order
flips every round) on the same model and engine settings, per dtype (float32 and bfloat16):
  grounded  batch 1, chats whose answer copies or edits text given in the prompt (rename a variable,
            fix a typo in a paragraph, change a JSON field, reformat a list): where drafts get accepted;
  open      batch 1, chats with nothing to copy (explain, write a poem): drafting should cost ~nothing;
  batch     --batch-size sequences at once (grounded and open prompts alternating).
Greedy decoding (temperature 0), so on and off produce the same tokens. Grounded answers end where the
model ends them (EOS, or --max-new-tokens): past its answer a small model, its EOS ignored, starts an
unrelated conversation, which is open text, not a copy (the embedded model's copies are 30-60 tokens). Open
and batch answers ignore EOS up to --max-new-tokens. Weights as the servers load them
(CPU_PACKED_WEIGHTS=auto on a CPU). Reported per workload and setting: generated tokens/s over the
workload's wall time (best and median over rounds), the on/off ratio of the medians, the acceptance rate
(accepted / drafted tokens) and the mean time to first token.

  python bench/speculative.py                    # the full run (minutes; run it on a quiet machine)
  python bench/speculative.py --smoke            # < 1 min: float32, 1 round, short answers
  python bench/speculative.py --batch-sizes 1,2,4,8,16 --workloads batch --max-batch 64
                                                 # where drafting stops paying (SPECULATIVE_MAX_BATCH)
Writes JSON with every round to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from harness.host import cpu_model
from harness.models import model_dir

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He cleaned the great lens, "
             "trimmed the wick and wrote the weather in his logbook. Ships passing in the night never saw him, "
             "but they saw his light, and that was enough for him.")
GROUNDED = [
    f"Repeat this code with the variable `subtotal` renamed to `net`. Reply with only the code.\n\n```python\n{CODE}```",
    f"Repeat this paragraph exactly, but replace 'lighthouse keeper' with 'old sailor':\n\n{PARAGRAPH}",
    'Return this JSON with "city" changed to "Lyon", nothing else:\n'
    '{"name": "Marie Curie", "born": 1867, "city": "Warsaw", "fields": ["physics", "chemistry"], "nobel": 2}',
    "Rewrite this list as a numbered list, same items and order:\n- apples\n- pears\n- plums\n- cherries\n"
    "- grapes\n- lemons\n- oranges\n- figs",
]
OPEN = [
    "Explain in a few sentences how a hash table works.",
    "Write a short poem about the sea at night.",
    "What are three good habits for writing maintainable software?",
    "Describe the water cycle to a ten-year-old.",
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint folder (default: the embedded model)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--k", type=int, default=4, help="SPECULATIVE_TOKENS when on")
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=None, help="SPECULATIVE_MAX_BATCH (default: the engine's)")
    parser.add_argument("--workloads", default="grounded,open,batch")
    parser.add_argument("--batch-sizes", default="16", help="sequences at once in the batch workload")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--smoke", action="store_true", help="< 1 min: float32, 1 round, 24 tokens, 1 prompt each")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.smoke:
        args.dtypes, args.rounds, args.max_new_tokens = "float32", 1, 24
        args.batch_sizes = "4"
    return args


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def run_workload(engine, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = True) -> dict:
    """All prompts at once, greedy, to max_new_tokens each (or EOS) -> tokens, seconds, TTFT, draft counters."""
    from llm_api.engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, do_sample=False, ignore_eos=ignore_eos)
    before = engine.stats()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    first: dict[str, float] = {}
    tokens = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += len(output.new_token_ids)
            first.setdefault(output.request_id, time.perf_counter() - start)
    seconds = time.perf_counter() - start
    after = engine.stats()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ttft_s": statistics.mean(first.values()), "drafted": drafted, "accepted": accepted,
            "steps": after.num_steps - before.num_steps}


def main():
    args = parse_args()
    from transformers import AutoTokenizer

    from llm_api.engine.engine import EngineConfig, LLMEngine
    from llm_api.model.loader import load
    from llm_api.model.settings import Settings

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    grounded = [chat_ids(tokenizer, text) for text in GROUNDED]
    open_ = [chat_ids(tokenizer, text) for text in OPEN]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    workloads: list[tuple[str, int, list[list[int]]]] = []
    for name in args.workloads.split(","):
        if name == "grounded":
            workloads += [("grounded", 1, [p]) for p in grounded[: 1 if args.smoke else None]]
        elif name == "open":
            workloads += [("open", 1, [p]) for p in open_[: 1 if args.smoke else None]]
        elif name == "batch":
            mixed = [p for pair in zip(grounded, open_) for p in pair]
            workloads += [("batch", size, [mixed[i % len(mixed)] for i in range(size)]) for size in batch_sizes]
        else:
            raise SystemExit(f"unknown workload {name!r}")
    results = []
    print(f"device {device}, k={args.k}, ngram {args.ngram_min}..{args.ngram_max}, {args.max_new_tokens} tokens, "
          f"{args.rounds} rounds; torch {torch.__version__}, {cpu_model()}")
    for dtype_name in args.dtypes.split(","):
        # Loaded and run as the servers do (on a CPU: CPU_PACKED_WEIGHTS as set, auto by default; FUSED_KERNELS,
        # with the C kernels where they build).
        settings = Settings.from_env({**os.environ, "MODEL_PATH": str(path), "DTYPE": dtype_name, "DEVICE_MAP": device})
        model = load(settings).model
        common = dict(block_size=16, num_blocks=1024, max_num_seqs=max(batch_sizes + [16]), max_num_batched_tokens=2048,
                      ngram_min=args.ngram_min, ngram_max=args.ngram_max, fused_kernels=settings.fused_kernels,
                      cpu_kernels_cache=settings.cache_dir)
        if args.max_batch is not None:
            common["speculative_max_batch"] = args.max_batch
        engines = {"off": LLMEngine(model, EngineConfig(**common, speculative_tokens=0), {tokenizer.eos_token_id}),
                   "on": LLMEngine(model, EngineConfig(**common, speculative_tokens=args.k), {tokenizer.eos_token_id})}
        for engine in engines.values():  # warm up (first-call allocations, kernel selection)
            run_workload(engine, [open_[0]], 4)
        for name, size, prompts in workloads:
            rounds: dict[str, list[dict]] = {"off": [], "on": []}
            for r in range(args.rounds):
                for setting in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    rounds[setting].append(run_workload(engines[setting], prompts, args.max_new_tokens,
                                                        ignore_eos=name != "grounded"))
            row = {"dtype": dtype_name, "workload": name, "batch": size, "rounds": rounds}
            for setting in ("off", "on"):
                rates = [x["tokens_per_s"] for x in rounds[setting]]
                row[setting] = {"tokens_per_s_best": max(rates), "tokens_per_s_median": statistics.median(rates),
                                "ttft_s_mean": statistics.mean(x["ttft_s"] for x in rounds[setting])}
            drafted = sum(x["drafted"] for x in rounds["on"])
            row["acceptance_rate"] = sum(x["accepted"] for x in rounds["on"]) / drafted if drafted else 0.0
            row["speedup"] = row["on"]["tokens_per_s_median"] / row["off"]["tokens_per_s_median"]
            results.append(row)
            print(f"{dtype_name:9} {name:8} batch {size:3}  off {row['off']['tokens_per_s_median']:7.1f} tok/s  "
                  f"on {row['on']['tokens_per_s_median']:7.1f} tok/s  x{row['speedup']:.2f}  "
                  f"acceptance {row['acceptance_rate']:.2f}  ttft off {row['off']['ttft_s_mean']*1000:.0f} ms "
                  f"on {row['on']['ttft_s_mean']*1000:.0f} ms", flush=True)
        del engines, model
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "device": device, "results": results}, indent=1))


if __name__ == "__main__":
    main()
