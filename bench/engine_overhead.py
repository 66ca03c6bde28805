"""Decode throughput of the paged engine vs a bare Hugging Face decode loop, same model/dtype/batch/context.

For each (batch size, context length), in alternating rounds of single timed steps:
  bare   the stock model with its own cache (DynamicCache, or StaticCache with --bare-cache static),
         one token per row per forward, greedy argmax, no scheduling;
  engine ``LLMEngine.step()`` with every request decoding (scheduler, packed inputs, paged attention,
         sampler, stop checks).
Both start from a synthetic context of the given length: the prompt's K/V are random numbers rather
than a real prefill (prefilling 64 x 1k tokens takes minutes on a small CPU and is not what is measured).
For the engine the prefill step runs the real scheduler and block allocation with the forward skipped.

Tokens/s come from the fastest step of each (the least disturbed on a shared machine); the median
ratio is printed beside them. Prints a table and writes JSON (with every step's seconds) to --out.
  python bench/engine_overhead.py --steps 4 --rounds 3 --out /tmp/engine_overhead.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from harness.host import cpu_model
from harness.models import model_dir
from harness.report import write_json


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint folder (default: the embedded model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch-sizes", default="16,64")
    parser.add_argument("--context-lens", default="1024,64")
    parser.add_argument("--steps", type=int, default=4, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating bare/engine rounds")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--bare-cache", default="dynamic", choices=["dynamic", "static"])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser.parse_args()


def load_model(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()


def kv_shape(model):
    config = model.config
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, num_kv_heads, head_dim


def bare_decoder(model, batch_size, context_len, max_steps, cache_kind):
    """-> a function running one decode step of the stock model at this batch (greedy argmax)."""
    from transformers import DynamicCache, StaticCache

    num_layers, num_kv_heads, head_dim = kv_shape(model)
    generator = torch.Generator().manual_seed(0)
    if cache_kind == "static":
        cache = StaticCache(config=model.config, max_cache_len=context_len + max_steps + 1)
    else:
        cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for layer_idx in range(num_layers):  # the synthetic context: [B, Hkv, L, D] per layer
            shape = (batch_size, num_kv_heads, context_len, head_dim)
            cache.update(torch.randn(shape, generator=generator, dtype=model.dtype),
                         torch.randn(shape, generator=generator, dtype=model.dtype), layer_idx,
                         {"cache_position": torch.arange(context_len)})
    state = {"next_ids": torch.randint(0, model.config.vocab_size, (batch_size, 1), generator=generator),
             "position": context_len}

    @torch.inference_mode()
    def step():
        position = state["position"]
        logits = model(input_ids=state["next_ids"], past_key_values=cache, use_cache=True,
                       position_ids=torch.full((batch_size, 1), position),
                       cache_position=torch.tensor([position])).logits
        state["next_ids"] = logits[:, -1].argmax(dim=-1, keepdim=True)
        state["next_ids"].tolist()  # what a server does with them: take them to the host
        state["position"] = position + 1

    return step


def engine_decoder(model, batch_size, context_len, max_steps, block_size):
    """-> (a function running one ``LLMEngine.step()`` with every request decoding, the engine)."""
    from llm_api.engine.engine import EngineConfig, LLMEngine
    from llm_api.engine.sampling_params import SamplingParams

    num_tokens = context_len + max_steps + 2
    config = EngineConfig(block_size=block_size, num_blocks=batch_size * -(-num_tokens // block_size),
                          max_num_seqs=batch_size, max_num_batched_tokens=batch_size * context_len,
                          enable_prefix_caching=False)
    engine = LLMEngine(model, config, eos_token_ids=set())
    generator = torch.Generator().manual_seed(0)
    for cache in engine.kv_cache.key_caches + engine.kv_cache.value_caches:
        cache.normal_(generator=generator)  # the synthetic context
    params = SamplingParams(max_new_tokens=max_steps + 2, do_sample=False)
    for i in range(batch_size):
        prompt = torch.randint(0, model.config.vocab_size, (context_len,), generator=generator).tolist()
        engine.add_request(f"r{i}", prompt, params)

    # The prefill step: real scheduling and block allocation, forward skipped (the K/V are synthetic).
    real_execute = engine.runner.execute

    def skip_forward(output):
        engine.runner.block_tables.update(output)  # the runner's tables follow the scheduler's deltas
        scheduled = output.scheduled
        return (torch.zeros(sum(s.samples for s in scheduled), model.config.vocab_size, dtype=model.dtype),
                [s.request for s in scheduled if s.samples])

    engine.runner.execute = skip_forward
    engine.step()
    engine.runner.execute = real_execute
    assert engine.stats().num_running == batch_size

    def step():
        outputs = engine.step()
        assert len(outputs) == batch_size and not any(o.finished for o in outputs)

    return step, engine


def time_steps(step, steps, step_seconds: list) -> None:
    for _ in range(steps):
        start = time.perf_counter()
        step()
        step_seconds.append(time.perf_counter() - start)


def measure(bare_model, engine_model, batch_size, context_len, args):
    """Alternate rounds of bare and engine steps; -> the seconds of every timed step of each."""
    max_steps = (args.rounds + 1) * args.steps + args.warmup
    bare_step = bare_decoder(bare_model, batch_size, context_len, max_steps, args.bare_cache)
    engine_step, engine = engine_decoder(engine_model, batch_size, context_len, max_steps, args.block_size)
    for _ in range(args.warmup):
        bare_step()
        engine_step()
    bare, paged = [], []
    for _ in range(args.rounds):
        time_steps(bare_step, args.steps, bare)
        time_steps(engine_step, args.steps, paged)
    for i in range(batch_size):
        engine.abort_request(f"r{i}")
    return bare, paged


def main():
    args = parse_args()
    dtype = getattr(torch, args.dtype)
    model_path = model_dir(args.model)
    bare_model = load_model(model_path, dtype)
    engine_model = load_model(model_path, dtype)  # the engine switches its attention to the paged one
    rows = []
    print(f"model {model_path} dtype {args.dtype} threads {torch.get_num_threads()} bare cache {args.bare_cache}")
    print(f"{'batch':>5} {'context':>7} {'bare tok/s':>11} {'engine tok/s':>12} {'engine/bare':>11} {'median ratio':>12}")
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        for context_len in [int(c) for c in args.context_lens.split(",")]:
            bare_seconds, engine_seconds = measure(bare_model, engine_model, batch_size, context_len, args)
            # The fastest step of each is the one least disturbed by other work on a shared machine.
            bare, engine = batch_size / min(bare_seconds), batch_size / min(engine_seconds)
            median_ratio = statistics.median(bare_seconds) / statistics.median(engine_seconds)
            rows.append({"batch_size": batch_size, "context_len": context_len, "bare_tokens_per_s": bare,
                         "engine_tokens_per_s": engine, "ratio": engine / bare, "median_ratio": median_ratio,
                         "bare_step_seconds": bare_seconds, "engine_step_seconds": engine_seconds})
            print(f"{batch_size:>5} {context_len:>7} {bare:>11.1f} {engine:>12.1f} {engine / bare:>11.2f}"
                  f" {median_ratio:>12.2f}", flush=True)
    result = {
        "model": str(model_path), "dtype": args.dtype, "steps": args.steps, "rounds": args.rounds,
        "warmup": args.warmup,
        "block_size": args.block_size, "bare_cache": args.bare_cache, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "machine": cpu_model(),
        "rows": rows,
    }
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
