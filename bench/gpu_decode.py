"""Offline decode and prefill throughput of the paged engine on a GPU, against generate() and the roofline.

Issue 4, part 4. Random weights of real model shapes (SmolLM2-135M, Qwen2.5-0.5B, Llama-3.1-8B; configs
written below, no downloads), bf16, built on the device once per model. For each batch size, prompts of
``--context-len`` random tokens (1024), every request running its full length (ignore_eos, no EOS id):

  engine           a fresh ``LLMEngine`` per batch (block_size 16, a pool sized for the batch, max_num_seqs =
                   batch, attention_backend "auto", CUDA graphs on). Prefill tok/s = B x context / the time
                   until every request has its first token; decode tok/s = B x steps / the time of ``--steps``
                   ``step()`` calls after ``--warmup`` untimed ones, every request decoding in each.
  generate         ``model.generate()`` with the stock model (sdpa attention, default DynamicCache): prefill =
                   a call with max_new_tokens=1; decode tok/s = B x (steps - 1) / (full call - prefill call).
  static+compile   the same with a ``StaticCache`` (one per batch, reset between calls), which makes
                   generate() compile its decode forward (transformers' default CompileConfig: inductor,
                   "reduce-overhead"); the first (compiling) call is timed apart. Failures are recorded.
  roofline         tokens/s <= B x bandwidth / (weight bytes read per step + B x KV bytes per sequence),
                   bandwidth = the best of several large device-to-device copies (bytes = read + write).

  products alone   the step's weight products (as the step runs them, merged where the engine merged them,
                   and one by one) at batch 1 in one CUDA graph, nothing else: their read rate, and what is
                   left of a step beside them (issue 39).

Also: CUDA graphs on versus off (EngineConfig.cuda_graphs) for the 135M model at batch 1. A combination
that would not fit in free memory (estimated) is recorded as skipped; one that raises (OOM, compile
error) is recorded with its error and the run goes on. The JSON (``--out``) is rewritten after every
measurement, so a run cut off by a time limit keeps what it measured; ``--max-seconds`` stops starting
new measurements after that long (they are recorded as skipped). ``--models`` splits a run across calls.

  python bench/gpu_decode.py --out bench/results/gpu_decode.json
  python bench/gpu_decode.py --models llama-3.1-8b --batches 1,64 --out /tmp/llama.json
  python bench/gpu_decode.py --models llama-3.1-8b --batches 1,64 --no-fused-layers   # the fused form before
  python bench/gpu_decode.py --smoke --out /tmp/smoke.json   # tiny fp32 model on CPU, a few seconds
  python bench/gpu_decode.py --summarize /tmp/llama.json ...   # the tables of earlier runs
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from harness.gpu_timing import graph_replay_seconds
from harness.host import cpu_model

# Make `llm_api` importable when run as `python bench/gpu_decode.py` from anywhere.

MODEL_NAMES = ("smollm2-135m", "qwen2.5-0.5b", "llama-3.1-8b")
SMOKE_MODEL = "tiny-llama"
DEFAULT_BATCHES = "1,8,32,64,128"
# Each distinct batch can cost torch.compile a (re)compilation; these fit the whole run in ~8 minutes.
DEFAULT_COMPILE_BATCHES = "1,64"
GRAPHS_MODEL = "smollm2-135m"


def model_config(name: str):
    """The transformers config of one benchmarked shape (values from the models' published config.json)."""
    from transformers import LlamaConfig, Qwen2Config

    if name == "smollm2-135m":  # HuggingFaceTB/SmolLM2-135M: Llama, 9 heads of 64, GQA 3, tied
        return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_act="silu",
                           max_position_embeddings=8192, rms_norm_eps=1e-5,
                           rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                           attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
                           bos_token_id=1, eos_token_id=2)
    if name == "qwen2.5-0.5b":  # Qwen/Qwen2.5-0.5B: qkv bias, 14 heads of 64, GQA 2, tied, no sliding window
        return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                           num_attention_heads=14, num_key_value_heads=2, hidden_act="silu",
                           max_position_embeddings=32768, rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                           use_sliding_window=False, sliding_window=32768, max_window_layers=24,
                           tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643)
    if name == "llama-3.1-8b":  # meta-llama/Llama-3.1-8B: 32 heads of 128, GQA 8, llama3 RoPE scaling, untied
        return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                           max_position_embeddings=131072, rms_norm_eps=1e-5,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192},
                           attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
                           bos_token_id=128000, eos_token_id=128001)
    if name == SMOKE_MODEL:
        return LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           tie_word_embeddings=False)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODEL_NAMES)}")


@dataclass(frozen=True)
class BenchSettings:
    device: str  # "cuda" | "cpu" (smoke)
    dtype: str
    models: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    compile_batch_sizes: tuple[int, ...]
    context_len: int
    decode_steps: int  # timed engine decode steps; generate() makes this many new tokens
    warmup_steps: int
    block_size: int
    max_num_batched_tokens: int
    graphs_model: str | None
    graphs_batch_size: int
    copy_bytes: int  # size of each buffer of the bandwidth copy
    copy_trials: int
    generate_repeats: int  # generate() timings are the best of this many calls
    max_seconds: float | None
    smoke: bool
    fused_kernels: bool = True  # the owned decoder on the Triton kernel set (off: the torch set)
    fused_layers: bool = True  # ... with merged q/k/v and gate/up products (llm_api.models.linear)
    one_row_kernel: bool = True  # batch-1 products by llm_api.kernels.gemv where its rule takes them


def parse_settings(argv=None) -> tuple[BenchSettings, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODEL_NAMES), help=f"comma list of {', '.join(MODEL_NAMES)}")
    parser.add_argument("--batches", default=DEFAULT_BATCHES, help="batch sizes (comma list)")
    parser.add_argument("--compile-batches", default=DEFAULT_COMPILE_BATCHES,
                        help="batch sizes for static cache + torch.compile ('all', or '' for none)")
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps (and generate's new tokens)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed engine decode steps before timing")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="start no new measurement after this many seconds (recorded as skipped)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny fp32 Llama on CPU, batches 1 and 2, context 32, no torch.compile: checks the "
                             "script end to end in seconds")
    parser.add_argument("--no-fused-kernels", action="store_true",
                        help="the engine without its fused RMSNorm and rotary kernels (transformers' code)")
    parser.add_argument("--no-fused-layers", action="store_true",
                        help="the fused RMSNorm and rotary kernels only: transformers' decoder layers around them "
                             "(the fused form before issue 39)")
    parser.add_argument("--no-gemv", action="store_true",
                        help="batch-1 products by cuBLAS only, never llm_api.kernels.gemv (the form before it)")
    parser.add_argument("--partition-min-tokens", type=int, default=None,
                        help="the decode attention's PARTITION_MIN_TOKENS knob (llm_api.kernels.decode_attention)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.no_gemv:
        from llm_api.kernels import gemv

        gemv.mode = "library"
    if args.partition_min_tokens:
        from llm_api.kernels import decode_attention

        decode_attention.PARTITION_MIN_TOKENS = args.partition_min_tokens

    def int_list(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split(",") if part.strip())

    out = Path(args.out) if args.out else None
    if args.smoke:
        # 32 decode steps: generate()'s decode time is the full call minus the prefill call, and with fewer
        # steps a loaded machine could stall a prefill call for longer than the whole decode took.
        return BenchSettings(
            device="cpu", dtype="float32", models=(SMOKE_MODEL,), batch_sizes=(1, 2), compile_batch_sizes=(),
            context_len=32, decode_steps=32, warmup_steps=2, block_size=16, max_num_batched_tokens=1024,
            graphs_model=SMOKE_MODEL, graphs_batch_size=1, copy_bytes=16 << 20, copy_trials=3,
            generate_repeats=3, max_seconds=args.max_seconds, smoke=True), out
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    unknown = [m for m in models if m not in MODEL_NAMES]
    if unknown or not models:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODEL_NAMES)}")
    batch_sizes = int_list(args.batches)
    compile_batches = batch_sizes if args.compile_batches.strip() == "all" else int_list(args.compile_batches)
    if not batch_sizes or min(batch_sizes) < 1 or args.steps < 2 or args.context_len < 1:
        parser.error("need batch sizes >= 1, --steps >= 2 and --context-len >= 1")
    if not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --smoke for the CPU check")
    return BenchSettings(
        device="cuda", dtype="bfloat16", models=models, batch_sizes=batch_sizes,
        compile_batch_sizes=tuple(b for b in compile_batches if b in batch_sizes),
        context_len=args.context_len, decode_steps=args.steps, warmup_steps=args.warmup, block_size=16,
        max_num_batched_tokens=args.max_num_batched_tokens,
        graphs_model=GRAPHS_MODEL if GRAPHS_MODEL in models else None, graphs_batch_size=1,
        copy_bytes=1 << 30, copy_trials=10, generate_repeats=1, max_seconds=args.max_seconds, smoke=False,
        fused_kernels=not args.no_fused_kernels, fused_layers=not args.no_fused_layers,
        one_row_kernel=not args.no_gemv), out


# ----------------------------------------------------------------------------------------- helpers


class Clock:
    """Wall time since the start, and the --max-seconds budget."""

    def __init__(self, max_seconds: float | None):
        self.start = time.perf_counter()
        self.max_seconds = max_seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self) -> bool:
        return self.max_seconds is not None and self.elapsed() > self.max_seconds


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> int:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def failed(error: BaseException) -> dict:
    # The last frames say where it broke (the engine's kernels, inductor, the cache...).
    where = traceback.format_exception(type(error), error, error.__traceback__)[-3:]
    return {"status": "error", "error": f"{type(error).__name__}: {error}"[:2000], "where": "".join(where)[-2000:]}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        name = f"CPU {cpu_model()} ({os.cpu_count()} cores)"
        total = None
    return {
        "device": name, "device_memory_bytes": total, "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": package_version("triton"), "transformers": package_version("transformers"),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# --------------------------------------------------------------------------------------- bandwidth


def copy_bandwidth(device: torch.device, num_bytes: int, trials: int) -> dict:
    """Best of ``trials`` copies of one ``num_bytes`` buffer into another: bytes moved = read + write."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    seconds = []
    for _ in range(trials):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1000)
        else:
            begin = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - begin)
    del src, dst
    best = min(seconds)
    return {"buffer_bytes": num_bytes, "bytes_moved_per_copy": 2 * num_bytes, "trial_seconds": seconds,
            "best_bytes_per_s": 2 * num_bytes / best}


# ------------------------------------------------------------------------------------------ models


@dataclass(frozen=True)
class ModelFacts:
    """Shape numbers and byte counts of one built model, for the roofline and the memory estimates."""

    num_params: int
    weight_bytes: int  # resident
    weight_bytes_read_per_step: int  # all weights but an untied input embedding (only B rows of it are read)
    kv_bytes_per_token: int  # K and V, all layers
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    element_size: int


def build_model(name: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    config = model_config(name)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def model_facts(model) -> ModelFacts:
    config = model.config
    unique = {id(p): p for p in model.parameters()}
    weight_bytes = sum(p.numel() * p.element_size() for p in unique.values())
    input_weight = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is input_weight
    read = weight_bytes - (0 if tied else input_weight.numel() * input_weight.element_size())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    element_size = input_weight.element_size()
    return ModelFacts(
        num_params=sum(p.numel() for p in unique.values()), weight_bytes=weight_bytes,
        weight_bytes_read_per_step=read,
        kv_bytes_per_token=2 * config.num_hidden_layers * num_kv_heads * head_dim * element_size,
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, vocab_size=config.vocab_size, tied_embeddings=tied, element_size=element_size,
    )


def config_summary(model) -> dict:
    config = model.config
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
            "rope_parameters", "tie_word_embeddings", "attention_bias", "use_sliding_window")
    return {k: getattr(config, k) for k in keys if hasattr(config, k)}


def activation_bytes_per_token(facts: ModelFacts) -> int:
    """A generous bound on one layer's live activations per token during a prefill forward."""
    widths = (6 * facts.hidden_size + 4 * facts.intermediate_size
              + (facts.num_heads + 2 * facts.num_kv_heads) * facts.head_dim)
    return int(1.25 * widths * facts.element_size)


def prompts_for(batch_size: int, context_len: int, vocab_size: int) -> torch.Tensor:
    """[B, context_len] random token ids, the same for the engine and generate() at this batch."""
    generator = torch.Generator().manual_seed(1000 + batch_size)
    return torch.randint(0, vocab_size, (batch_size, context_len), generator=generator)


def roofline(facts: ModelFacts, batch_size: int, mean_context_len: float, bandwidth: float) -> dict:
    kv_bytes = batch_size * mean_context_len * facts.kv_bytes_per_token
    step_bytes = facts.weight_bytes_read_per_step + kv_bytes
    return {"tokens_per_s": batch_size * bandwidth / step_bytes, "bandwidth_bytes_per_s": bandwidth,
            "weight_bytes_read": facts.weight_bytes_read_per_step, "kv_bytes_read": kv_bytes,
            "mean_context_len": mean_context_len}


# ------------------------------------------------------------------------------------------ engine


def engine_estimate(facts: ModelFacts, batch_size: int, settings: BenchSettings) -> int:
    tokens_per_seq = settings.context_len + settings.warmup_steps + settings.decode_steps + 2
    pool = (batch_size * cdiv(tokens_per_seq, settings.block_size) + 8) * settings.block_size
    prefill_tokens = min(batch_size * settings.context_len, settings.max_num_batched_tokens)
    return (pool * facts.kv_bytes_per_token + prefill_tokens * activation_bytes_per_token(facts)
            + 4 * batch_size * facts.vocab_size * 4)


def run_engine(model, prompts: torch.Tensor, settings: BenchSettings, device: torch.device,
               cuda_graphs: bool = True) -> dict:
    """One fresh engine: prefill all of ``prompts`` [B, L], then time the decode steps."""
    from llm_api.engine.engine import EngineConfig, LLMEngine
    from llm_api.engine.sampling_params import SamplingParams

    batch_size, context_len = prompts.shape
    token_budget = max(settings.max_num_batched_tokens, context_len)
    # Nobody finishes while timed: the prompts first served decode a token in each later prefill step.
    max_new_tokens = settings.warmup_steps + settings.decode_steps + 2 + cdiv(batch_size * context_len, token_budget)
    tokens_per_seq = context_len + max_new_tokens
    config = EngineConfig(
        block_size=settings.block_size,
        num_blocks=batch_size * cdiv(tokens_per_seq, settings.block_size) + 8,
        max_num_seqs=batch_size, max_num_batched_tokens=token_budget,
        max_model_len=tokens_per_seq + settings.block_size, attention_backend="auto", cuda_graphs=cuda_graphs,
        fused_kernels=settings.fused_kernels, fused_layers=settings.fused_layers,
    )
    reset_peak(device)
    begin = time.perf_counter()
    engine = LLMEngine(model, config, eos_token_ids=set())
    build_seconds = time.perf_counter() - begin
    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, do_sample=False, ignore_eos=True)
        request_ids = [f"b{batch_size}-{i}" for i in range(batch_size)]
        for request_id, prompt in zip(request_ids, prompts.tolist()):
            engine.add_request(request_id, prompt, params)

        waiting_first_token = set(request_ids)
        prefill_steps = 0
        synchronize(device)
        begin = time.perf_counter()
        while waiting_first_token:
            outputs = engine.step()
            prefill_steps += 1
            waiting_first_token.difference_update(o.request_id for o in outputs if o.new_token_ids)
            if prefill_steps > batch_size * cdiv(context_len, 16) + 16:
                raise RuntimeError(f"prefill did not finish in {prefill_steps} steps")
        synchronize(device)
        prefill_seconds = time.perf_counter() - begin

        def decode_step():
            outputs = engine.step()
            if len(outputs) != batch_size or any(o.finished or len(o.new_token_ids) != 1 for o in outputs):
                raise RuntimeError(f"a decode step gave {len(outputs)} outputs for {batch_size} running requests")

        for _ in range(settings.warmup_steps):
            decode_step()
        synchronize(device)
        begin = time.perf_counter()
        for _ in range(settings.decode_steps):
            decode_step()
        synchronize(device)
        decode_seconds = time.perf_counter() - begin
        stats = engine.stats()
        graph_sizes = getattr(engine, "cuda_graph_batch_sizes", None)
        return {
            "status": "ok",
            "decode_tokens_per_s": batch_size * settings.decode_steps / decode_seconds,
            "prefill_tokens_per_s": batch_size * context_len / prefill_seconds,
            "decode_seconds": decode_seconds, "decode_steps": settings.decode_steps,
            "warmup_steps": settings.warmup_steps, "prefill_seconds": prefill_seconds,
            "prefill_steps": prefill_steps, "build_seconds": build_seconds,
            "cuda_graphs": cuda_graphs, "attention_backend": engine.attention.name, "path": engine.runner.path.describe(),
            "cuda_graph_batch_sizes": sorted(graph_sizes) if graph_sizes is not None else None,
            "num_blocks": stats.num_total_blocks, "num_preemptions": stats.num_preemptions,
            "peak_memory_bytes": peak_memory(device),
            "config": asdict(config),
        }
    finally:
        del engine
        free_memory(device)


def warm_up_engine(model, settings: BenchSettings, vocab_size: int, device: torch.device) -> None:
    """One small untimed engine run, so the first timed one does not pay for kernel compilation."""
    run_engine(model, prompts_for(2, settings.context_len, vocab_size), settings, device)


def step_weights(model, merged: bool) -> list[torch.Tensor]:
    """The weights one decode step multiplies by, in the order it does: per layer each projection's, or with
    ``merged`` q/k/v and gate/up as the owned decoder merges them (``llm_api.models.linear.merge``: the modules'
    weights become views of the merged tensor, so the model holds no second copy); then the output head."""
    from llm_api.models.linear import GATE_UP, QKV, merge

    weights: list[torch.Tensor] = []
    for layer in model.get_decoder().layers:
        for owner, names, last in ((layer.self_attn, QKV, "o_proj"), (layer.mlp, GATE_UP, "down_proj")):
            projection = merge(owner, names) if merged else None
            if projection is not None and projection.weight is not None:
                weights.append(projection.weight)
            else:
                weights.extend(getattr(owner, name).weight for name in names)
            weights.append(getattr(owner, last).weight)
    weights.append(model.get_output_embeddings().weight)
    return weights


def run_products(model, device: torch.device, batch_size: int, merged: bool, replays: int = 20,
                 one_row_kernel: bool = False) -> dict:
    """The step's products alone (``step_weights``, random inputs of ``batch_size`` rows) in one CUDA graph:
    the time the weight reads take with nothing else on the GPU, and their read rate. ``one_row_kernel``:
    through ``kernels.gemv.row_product`` (its rule's configuration per shape), as the fused layers run a
    batch-1 step."""
    from llm_api.kernels import gemv

    weights = step_weights(model, merged)
    inputs = {k: torch.randn(batch_size, k, device=device, dtype=weights[0].dtype)
              for k in {w.shape[1] for w in weights}}
    product = gemv.row_product if one_row_kernel else torch.nn.functional.linear

    def products():
        for weight in weights:
            product(inputs[weight.shape[1]], weight)

    seconds = graph_replay_seconds(products, replays, warmup=3, device=device)
    read = sum(w.numel() * w.element_size() for w in weights)
    return {"status": "ok", "batch_size": batch_size, "merged": merged, "one_row_kernel": one_row_kernel,
            "products": len(weights),
            "seconds_per_step": seconds, "weight_bytes": read, "read_bytes_per_s": read / seconds,
            "tokens_per_s": batch_size / seconds}


# ---------------------------------------------------------------------------------------- generate


def generate_estimate(facts: ModelFacts, batch_size: int, settings: BenchSettings) -> int:
    tokens = batch_size * settings.context_len
    cache = batch_size * (settings.context_len + settings.decode_steps) * facts.kv_bytes_per_token
    return cache + tokens * activation_bytes_per_token(facts) + 4 * batch_size * facts.vocab_size * 4


def run_generate(model, prompts: torch.Tensor, settings: BenchSettings, device: torch.device,
                 static: bool) -> dict:
    """generate() at this batch: a max_new_tokens=1 call (prefill) and a full one; with ``static``, a
    StaticCache reused across the calls (which is what lets generate() compile its decode forward) and a
    first, compiling call timed apart."""
    batch_size, context_len = prompts.shape
    new_tokens = settings.decode_steps
    input_ids = prompts.to(device)
    cache = None
    if static:
        from transformers import StaticCache

        cache = StaticCache(config=model.config, max_cache_len=context_len + new_tokens)

    def call(max_new_tokens: int) -> float:
        kwargs = {}
        if cache is not None:
            cache.reset()
            kwargs["past_key_values"] = cache
        synchronize(device)
        begin = time.perf_counter()
        # generate() runs under its own no_grad (not inference_mode: the static cache is reset in place).
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=0,
                                **kwargs)
        synchronize(device)
        seconds = time.perf_counter() - begin
        if output.shape != (batch_size, context_len + max_new_tokens):
            raise RuntimeError(f"generate() returned {tuple(output.shape)}, expected "
                               f"{(batch_size, context_len + max_new_tokens)}")
        return seconds

    reset_peak(device)
    try:
        result = {"status": "ok", "cache": "StaticCache" if static else "DynamicCache",
                  "attn_implementation": model.config._attn_implementation, "new_tokens": new_tokens}
        if static:
            graphs_before = compiled_graph_count()
            result["first_call_seconds"] = call(new_tokens)  # compiles the decode forward for this batch
            result["compiled"] = getattr(model, "_compiled_call", None) is not None
            result["graphs_compiled_in_first_call"] = compiled_graph_count() - graphs_before
            graphs_before = compiled_graph_count()
        # Best of a few on a noisy machine (the smoke run's calls take milliseconds).
        prefill_seconds = min(call(1) for _ in range(settings.generate_repeats))
        total_seconds = min(call(new_tokens) for _ in range(settings.generate_repeats))
        if static:  # not 0: the timed calls paid for a recompilation
            result["graphs_compiled_in_timed_calls"] = compiled_graph_count() - graphs_before
        decode_seconds = total_seconds - prefill_seconds
        result.update({
            "prefill_seconds": prefill_seconds, "total_seconds": total_seconds,
            "prefill_tokens_per_s": batch_size * context_len / prefill_seconds,
            "decode_tokens_per_s": batch_size * (new_tokens - 1) / decode_seconds if decode_seconds > 0 else None,
            "peak_memory_bytes": peak_memory(device),
        })
        if result["decode_tokens_per_s"] is None:
            result.update(status="error", error="the full call took no longer than the prefill call")
        return result
    finally:
        del cache, input_ids
        free_memory(device)


def warm_up_generate(model, settings: BenchSettings, vocab_size: int, device: torch.device) -> None:
    input_ids = prompts_for(1, settings.context_len, vocab_size).to(device)
    model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=4,
                   min_new_tokens=4, pad_token_id=0)


def compiled_graph_count() -> int:
    """Frames dynamo has compiled so far in this process (to see recompilations inside timed calls)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def configure_compile() -> None:
    """Room for one graph per batch size and model (dynamo's default limit of 8 would silently fall back)."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)


def reset_compile() -> None:
    import torch._dynamo

    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------- run


class Results:
    """The JSON document, rewritten after every measurement."""

    def __init__(self, settings: BenchSettings, out: Path | None, device: torch.device, clock: Clock):
        self.out = out
        self.clock = clock
        self.doc: dict[str, Any] = {
            "benchmark": "bench/gpu_decode.py", "smoke": settings.smoke, "complete": False,
            "environment": environment(device), "settings": asdict(settings),
            "bandwidth": None, "models": {}, "rows": [], "cuda_graphs": skipped("not run"), "products": {},
            "elapsed_seconds": 0.0,
        }

    def save(self) -> None:
        self.doc["elapsed_seconds"] = self.clock.elapsed()
        for row in self.doc["rows"]:
            summarize_row(row)
        if self.out is None:
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        partial = self.out.with_name(self.out.name + ".partial")
        partial.write_text(json.dumps(self.doc, indent=2, default=str))
        partial.replace(self.out)


def measure(results: Results, clock: Clock, into: dict, key: str, label: str, fn, *args,
            skip_reason: str | None = None, **kwargs) -> dict:
    """``into[key]`` = the outcome of ``fn(*args, **kwargs)``, unless ``skip_reason`` or the time budget says
    skip; an exception (OOM, compile failure, engine error) is recorded, not raised. Saves the JSON."""
    if skip_reason is None and clock.spent():
        skip_reason = f"time budget spent (--max-seconds {clock.max_seconds:g})"
    if skip_reason is not None:
        outcome = skipped(skip_reason)
        print(f"[{clock.elapsed():7.1f}s] {label}: skipped ({skip_reason})", flush=True)
    else:
        print(f"[{clock.elapsed():7.1f}s] {label} ...", flush=True)
        begin = time.perf_counter()
        try:
            outcome = fn(*args, **kwargs) or {"status": "ok"}
        except Exception as error:  # record and go on with the next measurement
            outcome = failed(error)
            print(f"    {outcome['error'].splitlines()[0][:300]}", flush=True)
        outcome["wall_seconds"] = time.perf_counter() - begin
    into[key] = outcome
    results.save()
    return outcome


def memory_skip_reason(estimate: int, device: torch.device) -> str | None:
    """None when ``estimate`` bytes fit in free memory, else why the measurement is skipped."""
    available = free_memory(device)
    if estimate > 0.95 * available:
        return (f"estimated {estimate / 2**30:.1f} GiB needed, {available / 2**30:.1f} GiB free with the "
                f"model loaded")
    return None


def summarize_row(row: dict) -> None:
    engine, generate, compiled = row["engine"], row["generate"], row["static_compile"]
    engine_rate = engine.get("decode_tokens_per_s") if engine.get("status") == "ok" else None
    row["engine_fraction_of_roofline"] = engine_rate / row["roofline"]["tokens_per_s"] if engine_rate else None
    for key, other in (("engine_over_generate", generate), ("engine_over_static_compile", compiled)):
        other_rate = other.get("decode_tokens_per_s") if other.get("status") == "ok" else None
        row[key] = engine_rate / other_rate if engine_rate and other_rate else None


def run_model(name: str, settings: BenchSettings, device: torch.device, dtype: torch.dtype, bandwidth: float,
              results: Results, clock: Clock) -> None:
    model_doc: dict[str, Any] = {"status": "ok"}
    results.doc["models"][name] = model_doc
    started = clock.elapsed()
    if clock.spent():
        model_doc.update(skipped(f"time budget spent (--max-seconds {clock.max_seconds:g})"))
        results.save()
        return
    try:
        begin = time.perf_counter()
        model = build_model(name, device, dtype)
        synchronize(device)
        model_doc["build_seconds"] = time.perf_counter() - begin
    except Exception as error:
        model_doc.update(failed(error))
        results.save()
        return
    # No EOS id: generate() runs every row to max_new_tokens (the engine gets ignore_eos).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    facts = model_facts(model)
    model_doc.update({"config": config_summary(model), **asdict(facts)})
    print(f"{name}: {facts.num_params / 1e6:.1f}M parameters, {facts.weight_bytes / 2**30:.2f} GiB, "
          f"KV {facts.kv_bytes_per_token} B/token", flush=True)

    mean_context = settings.context_len + settings.warmup_steps + (settings.decode_steps + 1) / 2
    rows: list[dict[str, Any]] = []
    for batch_size in settings.batch_sizes:
        row: dict[str, Any] = {"model": name, "batch_size": batch_size, "context_len": settings.context_len,
               "roofline": roofline(facts, batch_size, mean_context, bandwidth),
               "engine": skipped("not run"), "generate": skipped("not run"),
               "static_compile": skipped("not in --compile-batches")}
        rows.append(row)
        results.doc["rows"].append(row)

    def prompts(batch_size):
        return prompts_for(batch_size, settings.context_len, facts.vocab_size)

    # Engine first, before generate()'s caches and compiled graphs hold any memory. The warm-up compiles
    # the engine's kernels, so that the first timed run does not pay for it.
    measure(results, clock, model_doc, "engine_warmup", f"{name}: engine warm-up", warm_up_engine, model, settings,
            facts.vocab_size, device)
    for row in rows:
        batch_size = row["batch_size"]
        measure(results, clock, row, "engine", f"{name}: engine B={batch_size}", run_engine, model,
                prompts(batch_size), settings, device,
                skip_reason=memory_skip_reason(engine_estimate(facts, batch_size, settings), device))

    if name == settings.graphs_model:
        batch_size = settings.graphs_batch_size
        graphs: dict[str, Any] = {"model": name, "batch_size": batch_size, "off": skipped("not run"), "on": skipped("not run")}
        results.doc["cuda_graphs"] = graphs
        for key, on in (("off", False), ("on", True)):
            measure(results, clock, graphs, key, f"{name}: engine B={batch_size} cuda_graphs={on}", run_engine,
                    model, prompts(batch_size), settings, device, cuda_graphs=on)
        if graphs["on"].get("status") == "ok" and graphs["off"].get("status") == "ok":
            graphs["speedup"] = graphs["on"]["decode_tokens_per_s"] / graphs["off"]["decode_tokens_per_s"]

    # The products alone at batch 1, as the step runs them (merged where the engine merged them) and one by
    # one, beside the engine's step: what is left of the step is everything else.
    if device.type == "cuda":
        products: dict[str, Any] = {}
        results.doc["products"][name] = products
        for key, merged in (("merged", True), ("separate", False)):
            measure(results, clock, products, key, f"{name}: products alone B=1 ({key})", run_products, model,
                    device, 1, merged)
        if settings.one_row_kernel:  # (with --no-gemv it would run cuBLAS again under this name)
            measure(results, clock, products, "merged, one-row kernel",
                    f"{name}: products alone B=1 (merged, gemv)", run_products, model, device, 1, True,
                    one_row_kernel=True)
        from llm_api.kernels import gemv

        # which way each one-row shape ran: (block_n, block_k, warps), or the library's
        model_doc["one_row_choices"] = {f"{key[2][0]}x{key[2][1]}{' silu' if key[4] else ''}":
                                        (None if c is None else [c.block_n, c.block_k, c.num_warps])
                                        for key, c in gemv.chosen().items()}
        # (torch's other BLAS front end picks its kernels by other rules: the small products may differ)
        default_blas = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            measure(results, clock, products, "merged, cublasLt", f"{name}: products alone B=1 (merged, cublasLt)",
                    run_products, model, device, 1, True)
        finally:
            torch.backends.cuda.preferred_blas_library(default_blas)

    # generate(): transformers' classes with the stock attention (the engine ran the owned decoder over the
    # same modules; it patched nothing into them).
    model.set_attn_implementation("sdpa")
    measure(results, clock, model_doc, "generate_warmup", f"{name}: generate warm-up", warm_up_generate, model,
            settings, facts.vocab_size, device)
    for row in rows:
        batch_size = row["batch_size"]
        measure(results, clock, row, "generate", f"{name}: generate B={batch_size}", run_generate, model,
                prompts(batch_size), settings, device, static=False,
                skip_reason=memory_skip_reason(generate_estimate(facts, batch_size, settings), device))
    configure_compile()
    for row in rows:
        batch_size = row["batch_size"]
        if settings.smoke:
            row["static_compile"] = skipped("--smoke: no torch.compile on CPU")
        elif batch_size in settings.compile_batch_sizes:
            measure(results, clock, row, "static_compile", f"{name}: generate static+compile B={batch_size}",
                    run_generate, model, prompts(batch_size), settings, device, static=True,
                    skip_reason=memory_skip_reason(generate_estimate(facts, batch_size, settings), device))
    reset_compile()  # frees the compiled graphs (and their CUDA graph pools) with the model

    model_doc["elapsed_seconds"] = clock.elapsed() - started
    del model
    free_memory(device)
    results.save()


# ------------------------------------------------------------------------------------------ output


def format_rate(measurement: dict, key: str = "decode_tokens_per_s") -> str:
    status = measurement.get("status")
    if status == "ok" and measurement.get(key):
        return f"{measurement[key]:.1f}"
    return {"skipped": "skip", "error": "error"}.get(str(status), "-")


def fused_label(settings: dict) -> str:
    if not settings.get("fused_kernels", True):
        return "off"
    if not settings.get("fused_layers", True):
        return "on (products unmerged)"
    return "on (merged products)" + ("" if settings.get("one_row_kernel", True) else ", batch-1 products by cuBLAS")


def print_table(doc: dict) -> None:
    env = doc["environment"]
    bandwidth = doc["bandwidth"]
    print(f"\n{env['device']} | torch {env['torch']} (CUDA {env['cuda']}) | triton {env['triton']} | "
          f"transformers {env['transformers']} | {env['date']} | fused kernels {fused_label(doc['settings'])}")
    if bandwidth:
        print(f"copy bandwidth {bandwidth['best_bytes_per_s'] / 1e9:.1f} GB/s (read + write, best of "
              f"{len(bandwidth['trial_seconds'])})")
    headers = ("model", "batch", "engine tok/s", "% roofline", "roofline tok/s", "generate tok/s",
               "engine/gen", "static+compile tok/s", "engine prefill tok/s", "generate prefill tok/s")
    widths = (14, 5, 12, 10, 14, 14, 10, 20, 20, 22)
    print(" ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in doc["rows"]:
        fraction, ratio = row.get("engine_fraction_of_roofline"), row.get("engine_over_generate")
        cells = (row["model"], str(row["batch_size"]), format_rate(row["engine"]),
                 f"{100 * fraction:.1f}%" if fraction else "-", f"{row['roofline']['tokens_per_s']:.1f}",
                 format_rate(row["generate"]), f"{ratio:.2f}" if ratio else "-",
                 format_rate(row["static_compile"]), format_rate(row["engine"], "prefill_tokens_per_s"),
                 format_rate(row["generate"], "prefill_tokens_per_s"))
        print(" ".join(c.rjust(w) for c, w in zip(cells, widths)))
    graphs = doc["cuda_graphs"]
    if "on" in graphs:
        speedup = graphs.get("speedup")
        print(f"CUDA graphs, {graphs['model']} batch {graphs['batch_size']}: on {format_rate(graphs['on'])}, "
              f"off {format_rate(graphs['off'])} tok/s" + (f", speedup {speedup:.2f}x" if speedup else ""))
    for name, model_doc in doc.get("models", {}).items():
        if model_doc.get("one_row_choices"):
            print(f"one-row products of {name} (None: cuBLAS): {model_doc['one_row_choices']}")
    for name, products in doc.get("products", {}).items():
        for key, result in products.items():
            if result.get("status") == "ok":
                print(f"products alone, {name} batch 1 ({key}, {result['products']}): "
                      f"{result['seconds_per_step'] * 1e3:.3f} ms a step, "
                      f"{result['read_bytes_per_s'] / 1e9:.0f} GB/s read, {result['tokens_per_s']:.1f} tok/s")
    problems = [(row["model"], row["batch_size"], key, row[key]) for row in doc["rows"]
                for key in ("engine", "generate", "static_compile") if row[key].get("status") == "error"]
    for model, batch_size, key, measurement in problems:
        print(f"error {model} B={batch_size} {key}: {measurement['error'].splitlines()[0][:300]}")
        print("    " + measurement.get("where", "").strip().replace("\n", "\n    ")[-600:])
    print(f"elapsed {doc['elapsed_seconds']:.1f} s")


def summarize(paths: list[str]) -> int:
    """The tables of earlier runs' JSON files (``--summarize FILE...``), a missing or unreadable one named."""
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            print(f"\n{path}: no results ({type(error).__name__}: {error})")
            continue
        print(f"\n{path}" + ("" if doc.get("complete") else " (cut off: the run did not finish)"))
        print_table(doc)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--summarize"]:
        return summarize(argv[1:])
    settings, out = parse_settings(argv)
    device = torch.device(settings.device)
    dtype = getattr(torch, settings.dtype)
    clock = Clock(settings.max_seconds)
    results = Results(settings, out, device, clock)
    env = results.doc["environment"]
    print(f"{env['device']} | torch {env['torch']} | triton {env['triton']} | transformers {env['transformers']}",
          flush=True)
    results.doc["bandwidth"] = copy_bandwidth(device, settings.copy_bytes, settings.copy_trials)
    bandwidth = results.doc["bandwidth"]["best_bytes_per_s"]
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    results.save()
    if settings.graphs_model is None:
        results.doc["cuda_graphs"] = skipped(f"{GRAPHS_MODEL} not in --models")
    for name in settings.models:
        run_model(name, settings, device, dtype, bandwidth, results, clock)
    results.doc["complete"] = True
    results.save()
    print_table(results.doc)
    if out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
