"""Where one CPU decode step goes, beside the host's memory roofline.

Loads the model the way the servers do (``llm_api.model.loader.load``: DTYPE, CPU_PACKED_WEIGHTS), builds
the paged engine, prefills ``--batch-sizes`` requests of a ``--prompt-tokens`` prompt each, and times decode
steps in alternating rounds of two kinds:

  plain         ``LLMEngine.step()`` untouched: the step's real time (tok/s = batch / median step);
  instrumented  the same step with timers around each part: the weight products (every linear layer, and
                the CPU kernels' ``row_product``: the output head), the CPU kernels' layers in C (a pure
                decode step's every layer in one ``decode_layers`` call, its attention included; else each
                layer's two calls ``layer_in`` and ``layer_out``: its products with its norms, rotary and
                SiLU x up), the attention over the paged cache (the backend's ``forward``, or the CPU kernels'
                ``paged_decode``; K/V store included), the rest of the model's forward (norms, rotary
                embedding, residuals, activations, transformers' Python), sampling (``Sampler``, logits
                processors included; a greedy step's argmax), and what is left of the step: scheduler, packing the inputs, stop
                checks. A part called inside another counts in the outer one only. The timers add ~1 us per
                call, so the parts are scaled to the plain step's median.

The engine runs as the servers run it: ``--fused true`` (FUSED_KERNELS; on a CPU the C kernels of
``llm_api.kernels.cpu``, built under LLM_API_CACHE) or ``false`` (transformers' code).

The roofline: ``--bandwidth-gib`` GiB of float32 summed with torch on the same threads (a read-only stream,
larger than the last-level cache unless that is huge: say so) gives the read bandwidth; one decode step must
read every weight once, so batch-1 decode is bounded by bandwidth / weight bytes tokens/s.

  python bench/decode_profile.py --dtype bfloat16 --packed auto --out /tmp/decode_profile.json
  python bench/decode_profile.py --smoke
Prints a markdown table; the figures in docs/benchmarks.md ("Where a CPU decode step goes") come from it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from harness.host import describe
from harness.report import markdown_table, write_json


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint folder (default: the embedded model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--packed", default="auto", choices=["auto", "true", "split", "false"],
                        help="CPU_PACKED_WEIGHTS")
    parser.add_argument("--fused", default="true", choices=["true", "false"], help="FUSED_KERNELS")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round and kind")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--bandwidth-gib", type=float, default=1.0)
    parser.add_argument("--smoke", action="store_true", help="a run of seconds: batch 1, 2 rounds of 2 steps")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser.parse_args()


def read_bandwidth(gib: float, repeats: int = 5) -> float:
    """Bytes per second of a float32 sum over ``gib`` GiB (the fastest of ``repeats``)."""
    data = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def weight_bytes(model) -> int:
    """Bytes one decode step reads: every parameter and buffer once, except the input embedding, of which a
    step reads only its B rows (unless the lm_head computes with that same tensor: tied and not packed)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.layout == torch.strided:  # (a packed weight is opaque: no data_ptr to share)
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    # (a GGUF model's embedding and head are quantized modules: their blocks, not a weight)
    embedding_module, head = model.get_input_embeddings(), model.get_output_embeddings()
    embedding = getattr(embedding_module, "weight", None)
    if embedding is None:
        embedding = embedding_module.blocks
    output_weight = getattr(head, "weight", None)
    if output_weight is None:
        output_weight = getattr(head, "blocks", None)
    if output_weight is None or output_weight.data_ptr() != embedding.data_ptr():
        total -= embedding.numel() * embedding.element_size()
    return total


class PartTimers:
    """Wall-clock seconds per part of a step, by wrapping the parts' callables (``install``/``remove``)."""

    PARTS = ("weight products", "layers in C", "attention", "other model ops", "sampling",
             "scheduler, inputs, stops")
    LEAVES = ("linear", "layer", "attention")  # (timed only where no other leaf is running)

    def __init__(self, engine):
        self.engine = engine
        self.seconds = dict.fromkeys(("linear", "layer", "attention", "forward", "sampling"), 0.0)
        self._undo = []
        self._inside = [False]

    def _wrap(self, owner, attribute, key):
        original = getattr(owner, attribute)
        seconds, inside, leaf = self.seconds, self._inside, key in self.LEAVES

        def timed(*args, **kwargs):
            if leaf and inside[0]:
                return original(*args, **kwargs)
            inside[0] = inside[0] or leaf
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[key] += time.perf_counter() - start
                if leaf:
                    inside[0] = False

        own = attribute in vars(owner)  # an instance attribute (restore it) or the class's method (drop ours)
        setattr(owner, attribute, timed)
        self._undo.append((owner, attribute, original if own else None))

    def install(self):
        engine = self.engine
        for module in engine.model.modules():
            if type(module).__name__ in ("Linear", "PackedLinear", "SplitLinear"):
                self._wrap(module, "forward", "linear")
        self._wrap(engine.runner.backend, "forward", "attention")
        self._wrap(engine.model, "forward", "forward")
        self._wrap(engine, "sampler", "sampling")  # (called as engine.sampler(logits, batch))
        self._wrap(engine, "_greedy_pick", "sampling")  # (a greedy step's argmax: a static method)
        from llm_api.kernels import cpu as cpu_kernels

        if cpu_kernels.loaded():  # (a kernel set is a module: its functions are looked up at each call)
            for name, key in (("row_product", "linear"), ("layer_in", "layer"), ("layer_out", "layer"),
                              ("decode_layers", "layer"),
                              ("paged_decode", "attention")):
                self._wrap(cpu_kernels, name, key)

    def remove(self):
        for owner, attribute, original in reversed(self._undo):
            if original is None:
                delattr(owner, attribute)  # back to the class's method
            else:
                setattr(owner, attribute, original)
        self._undo.clear()

    def reset(self):
        for key in self.seconds:
            self.seconds[key] = 0.0


def profile_batch(engine, batch_size, prompt_tokens, steps, rounds):
    from llm_api.engine.sampling_params import SamplingParams

    vocab = engine.vocab_size
    generator = torch.Generator().manual_seed(batch_size)
    timers = PartTimers(engine)
    plain, instrumented, parts = [], [], {key: [] for key in timers.seconds}
    for round_index in range(rounds):
        for kind in ("plain", "instrumented"):
            params = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
            for i in range(batch_size):
                prompt = torch.randint(0, vocab, (prompt_tokens,), generator=generator).tolist()
                engine.add_request(f"{kind}-{round_index}-{i}", prompt, params)
            while engine.scheduler.waiting:  # prefill (chunked if the budget says so), untimed
                engine.step()
            if kind == "instrumented":
                timers.install()
            for _ in range(steps):
                timers.reset()
                start = time.perf_counter()
                engine.step()
                seconds = time.perf_counter() - start
                if kind == "plain":
                    plain.append(seconds)
                else:
                    instrumented.append(seconds)
                    for key, value in timers.seconds.items():
                        parts[key].append(value)
            timers.remove()
            while engine.has_unfinished_requests():
                engine.step()
    step = statistics.median(plain)
    measured = statistics.median(instrumented)
    median = {key: statistics.median(values) for key, values in parts.items()}
    split = {
        "weight products": median["linear"],
        "layers in C": median["layer"],
        "attention": median["attention"],
        "other model ops": median["forward"] - median["linear"] - median["layer"] - median["attention"],
        "sampling": median["sampling"],
    }
    split["scheduler, inputs, stops"] = max(measured - sum(split.values()), 0.0)
    scale = step / measured  # the timers' own cost, spread over the parts
    return {"batch_size": batch_size, "step_s": step, "tokens_per_s": batch_size / step,
            "instrumented_step_s": measured, "parts_s": {k: v * scale for k, v in split.items()}}


def main():
    args = parse_args()
    if args.smoke:
        args.batch_sizes, args.steps, args.rounds, args.bandwidth_gib = "1", 2, 2, 0.25
    from llm_api.engine.engine import EngineConfig, LLMEngine
    from llm_api.model.loader import load
    from llm_api.model.settings import Settings

    env = dict(os.environ, DTYPE=args.dtype, CPU_PACKED_WEIGHTS=args.packed, FUSED_KERNELS=args.fused)
    if args.model:
        env["MODEL_PATH"] = args.model
    settings = Settings.from_env(env)
    lm = load(settings)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_tokens = args.prompt_tokens + args.steps + 4
    engine = LLMEngine(lm.model, EngineConfig(num_blocks=max(batch_sizes) * (-(-max_tokens // 16) + 1) + 8,
                                              max_num_seqs=max(batch_sizes), max_num_batched_tokens=2048,
                                              enable_prefix_caching=False, fused_kernels=settings.fused_kernels,
                                              cpu_kernels_cache=settings.cache_dir), set(lm.eos_token_ids))
    bandwidth = read_bandwidth(args.bandwidth_gib)
    weights = weight_bytes(lm.model)
    layout = type(lm.model.get_output_embeddings()).__name__  # Linear, PackedLinear or SplitLinear
    host = describe()
    results = [profile_batch(engine, b, args.prompt_tokens, args.steps, args.rounds) for b in batch_sizes]
    print(f"\nhost: {host}\n{args.dtype}, FUSED_KERNELS={args.fused} ({engine.runner.path.describe()}), products: {layout}; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"({args.bandwidth_gib} GiB float32 sum); weights read per step {weights / 1e6:.0f} MB; "
          f"batch-1 roofline {bandwidth / weights:.1f} tok/s\n")
    rows = [[part, *(f"{r['parts_s'][part] * 1e3:.1f} ({r['parts_s'][part] / r['step_s']:.0%})" for r in results)]
            for part in PartTimers.PARTS]
    rows.append(["**step**", *(f"**{r['step_s'] * 1e3:.1f}** = {r['tokens_per_s']:.1f} tok/s" for r in results)])
    print(markdown_table(["part of a decode step", *(f"batch {r['batch_size']} (ms)" for r in results)], rows))
    products = results[0]["parts_s"]["weight products"] + results[0]["parts_s"]["layers in C"]
    print(f"\nbatch {results[0]['batch_size']}: weight products and whole layers read {weights / products / 1e9:.1f} GB/s "
          f"({weights / products / bandwidth:.0%} of the measured bandwidth)")
    if args.out:
        write_json(args.out, {"host": host, "dtype": args.dtype, "products": layout, "bandwidth_bytes_per_s": bandwidth,
                              "weight_bytes": weights, "results": results})


if __name__ == "__main__":
    main()
