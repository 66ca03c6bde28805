"""Where a GPU decode step's time goes: the engine's step split into host phases, and its kernel launches.

Issue 26: at batch 1 a decode step of a small model is bound by the host, not by the GPU (on the lent
H200, 2026-11-26, SmolLM2-135M shapes decoded 406 tok/s with graphs, 2.5 ms a step, against a roofline of
0.07 ms). For one model of bench/gpu_decode.py (random bf16 weights of real shapes) and one batch, after a
prefill of ``--context-len`` random tokens and a warm-up, this times ``--steps`` decode steps and reports:

  phases   wall time per step of scheduler.schedule(), runner.execute() (inputs, graph replay or forward,
           logits), the sampler up to the token ids on the host (.tolist() waits for the GPU), and
           scheduler.update(); each phase is closed by a device synchronize, so a phase's time includes
           the GPU work it queued
  launches kernel launches and graph launches per step, and the top host functions (cProfile, tottime)
  ops      torch.profiler's top ops over 8 steps by self CPU time, and on a GPU by self CUDA time (the
           kernels inside the replayed graph)

  python bench/gpu_step_profile.py --model smollm2-135m --batch 1 --out /tmp/profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

from gpu_decode import MODEL_NAMES, build_model, cdiv, prompts_for, synchronize


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=MODEL_NAMES)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to check the script (a tiny run)")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


class PhaseTimer:
    """Wraps the engine's phases (bound methods) so that each call adds its synchronized wall time."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self.enabled = False

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            synchronize(self.device)
            begin = time.perf_counter()
            result = fn(*args, **kwargs)
            synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - begin
            return result
        return timed


def main(argv=None) -> int:
    args = parse_args(argv)
    from llm_api.engine.engine import EngineConfig, LLMEngine
    from llm_api.engine.sampling_params import SamplingParams

    device = torch.device(args.device)
    model = build_model(args.model, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.generation_config.eos_token_id = None
    prompts = prompts_for(args.batch, args.context_len, model.config.vocab_size)
    budget = max(16384, args.context_len)
    max_new = args.steps * 3 + 16 + cdiv(args.batch * args.context_len, budget)
    config = EngineConfig(block_size=16, num_blocks=args.batch * cdiv(args.context_len + max_new, 16) + 8,
                          max_num_seqs=args.batch, max_num_batched_tokens=budget,
                          max_model_len=args.context_len + max_new + 16)
    engine = LLMEngine(model, config, eos_token_ids=set())
    params = SamplingParams(max_new_tokens=max_new, do_sample=False, ignore_eos=True)
    for i, prompt in enumerate(prompts.tolist()):
        engine.add_request(str(i), prompt, params)
    while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(8):
        engine.step()

    timer = PhaseTimer(device)
    # The timing wrappers shadow the methods on these instances only (mypy refuses a method assigned).
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    engine.runner.execute = timer.wrap("execute", engine.runner.execute)  # type: ignore[method-assign]
    engine.sampler = timer.wrap("sample", engine.sampler)
    engine.scheduler.update = timer.wrap("update", engine.scheduler.update)  # type: ignore[method-assign]

    def seconds_per_step(steps: int) -> float:
        synchronize(device)
        begin = time.perf_counter()
        for _ in range(steps):
            engine.step()
        synchronize(device)
        return (time.perf_counter() - begin) / steps

    plain = seconds_per_step(args.steps)
    timer.enabled = True
    synced = seconds_per_step(args.steps)
    timer.enabled = False
    phases = {name: seconds / args.steps for name, seconds in timer.seconds.items()}

    profiler = cProfile.Profile()
    profiler.enable()
    seconds_per_step(args.steps)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)

    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # A few steps only: on the H200 (torch 2.11) a 50-step trace kept the events of its last 8 steps.
    profiled_steps = min(args.steps, 8)
    with profile(activities=activities) as prof:
        seconds_per_step(profiled_steps)
    events = prof.key_averages()
    launches = {e.key: e.count / profiled_steps for e in events
                if e.key in ("cudaLaunchKernel", "cudaGraphLaunch", "cuLaunchKernel", "cuLaunchKernelEx",
                             "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaLaunchKernelExC")}
    ops = events.table(sort_by="self_cpu_time_total", row_limit=15)
    if device.type == "cuda":  # the GPU's side: which kernels the replayed graph spends its time in
        ops += "\n" + events.table(sort_by="self_cuda_time_total", row_limit=20)

    doc = {"model": args.model, "batch": args.batch, "context_len": args.context_len, "steps": args.steps,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "step_seconds": plain, "step_seconds_with_phase_syncs": synced, "phase_seconds": phases,
           "calls_per_step": launches, "graph_sizes": engine.cuda_graph_batch_sizes,
           "cprofile": text.getvalue(), "ops": ops}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"{args.model} batch {args.batch}: step {plain * 1e3:.3f} ms ({args.batch / plain:.0f} tok/s); "
          f"with phase syncs {synced * 1e3:.3f} ms")
    for name, seconds in phases.items():
        print(f"  {name:9s} {seconds * 1e3:8.3f} ms")
    from llm_api.kernels import gemv

    # (which one-row product configuration each shape of the step ran: None is cuBLAS)
    print("  one-row products:", {tuple(key[2]): config for key, config in gemv.chosen().items()})
    print("  per step: " + ", ".join(f"{k} {v:.1f}" for k, v in launches.items()))
    print(text.getvalue()[:5000])
    print(ops[:9000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
