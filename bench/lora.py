"""Mixed LoRA batches against the base model alone, on the embedded model (the engine as the server runs it).

Rounds alternate (this machine's timings swing between runs; ratios inside one run hold):

* ``base``: N concurrent greedy requests on the base model;
* ``mixed``: the same N requests spread round-robin over 4 adapters and the base (MAX_LORAS=4: all resident);
* ``swapped``: the same mix with MAX_LORAS=2 (the scheduler runs at most 2 adapters at once beside the
  base; slots are refilled from the host copies), reporting the swaps and their time.

Throughput is generated tokens per second of wall time (prefill included). The target (issue 24) is
mixed >= 0.8 x base. Also reported: each adapter's resident size (its own A and B weights, as loaded in
the model's dtype) and, per swap, the seconds spent copying an adapter into a slot.

Adapters are random (non-zero A and B), written in PEFT's format (adapter_config.json +
adapter_model.safetensors) by this script, so it needs no peft.

    python bench/lora.py [--requests 16] [--tokens 64] [--rounds 3] [--rank 16] [--out result.json]
    python bench/lora.py --smoke        # 5 requests, 4 tokens, one round: a check that it runs (seconds)
    MODEL_PATH=FOLDER DEVICE_MAP=cuda DTYPE=bfloat16 python bench/lora.py --random-weights   # a GPU machine
                                        # (scripts/gpu_check.sh): FOLDER's config and tokenizer, random weights
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from harness.host import cpu_model

from llm_api.engine.engine import EngineConfig, LLMEngine
from llm_api.engine.sampling_params import SamplingParams
from llm_api.lora.layer import TARGET_NAMES
from llm_api.lora.registry import LoraRegistry
from llm_api.model.loader import load
from llm_api.model.settings import Settings

NUM_ADAPTERS = 4


def write_adapter(model, folder: Path, seed: int, rank: int, base_name: str) -> Path:
    """A random PEFT LoRA adapter on every q/k/v/o/gate/up/down projection of ``model``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for path, module in model.named_modules():
        if path.rsplit(".", 1)[-1] in TARGET_NAMES and hasattr(module, "in_features"):
            a = torch.randn(rank, module.in_features, generator=generator) / module.in_features**0.5
            b = torch.randn(module.out_features, rank, generator=generator) * 0.01
            weights[f"base_model.model.{path}.lora_A.weight"] = a
            weights[f"base_model.model.{path}.lora_B.weight"] = b
    save_file(weights, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(TARGET_NAMES), "base_model_name_or_path": base_name, "bias": "none"}))
    return folder


def random_checkpoint(source: str, folder: Path) -> str:
    """``source``'s config and tokenizer files with random weights (seeded) saved beside them: the model's
    shapes on a machine that lacks its weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "special_tokens_map.json"):
        if (Path(source) / name).is_file():
            shutil.copy(Path(source) / name, folder / name)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    return str(folder)


def run(engine: LLMEngine, prompts: list[list[int]], lora_ids: list[int], tokens: int, tag: str) -> float:
    """Tokens per second for all requests added at once and stepped to the end."""
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, (prompt, lora_id) in enumerate(zip(prompts, lora_ids)):
        engine.add_request(f"{tag}-{i}", prompt, params, lora_id=lora_id)
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="a few requests and tokens, one round")
    parser.add_argument("--random-weights", action="store_true",
                        help="MODEL_PATH's config and tokenizer with random weights (a machine without them)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.tokens, args.rounds = 5, 4, 1
    settings = Settings.from_env()
    result: dict = {"benchmark": "bench/lora.py", "smoke": args.smoke, "requests": args.requests,
                    "tokens": args.tokens, "rank": args.rank, "dtype": settings.dtype,
                    "cpu": cpu_model(), "torch_threads": torch.get_num_threads(), "device_map": settings.device_map,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "random_weights": args.random_weights}
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_weights:
            settings = dataclasses.replace(settings, model_path=random_checkpoint(settings.model_path,
                                                                                  Path(tmp) / "model"))
        engines, registries, ids = {}, {}, {}
        for kind, max_loras in (("mixed", NUM_ADAPTERS), ("swapped", 2)):
            lm = load(settings)
            registry = LoraRegistry(lm.model, max_loras, max(64, args.rank), settings.model_path)
            folders = [Path(tmp) / f"a{i}" for i in range(NUM_ADAPTERS)]
            for i, folder in enumerate(folders):
                if not folder.exists():
                    write_adapter(lm.model, folder, seed=i, rank=args.rank, base_name=settings.model_path)
            ids[kind] = [registry.load(f"a{i}", folder).lora_id for i, folder in enumerate(folders)]
            config = EngineConfig.from_settings(settings)
            engines[kind] = LLMEngine(lm.model, config, set(), lora=registry)
            registries[kind] = registry
        tokenizer = lm.tokenizer
        prompts = [tokenizer(f"Request {i}: write a short story about a lighthouse keeper.")["input_ids"]
                   for i in range(args.requests)]
        # Round-robin over the base (0) and the adapters: 16 requests -> 4 base + 3 per adapter (+ the rest).
        mix = {kind: [0 if i % (NUM_ADAPTERS + 1) == 0 else ids[kind][i % (NUM_ADAPTERS + 1) - 1]
                      for i in range(args.requests)] for kind in ids}
        rates: dict[str, list[float]] = {"base": [], "mixed": [], "swapped": []}
        for round_index in range(args.rounds):
            order = ["base", "mixed", "swapped"]
            order = order[round_index % 3:] + order[: round_index % 3]
            for kind in order:
                engine = engines["mixed" if kind == "base" else kind]
                lora_ids = [0] * args.requests if kind == "base" else mix[kind]
                rates[kind].append(run(engine, prompts, lora_ids, args.tokens, f"{kind}{round_index}"))
        adapter = registries["mixed"].get("a0")
        assert adapter is not None
        swap_stats = registries["swapped"].stats()
        mixed_stats = registries["mixed"].stats()
        result.update({
            "tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
            "tokens_per_s_rounds": rates,
            "mixed_over_base": statistics.median(rates["mixed"]) / statistics.median(rates["base"]),
            "swapped_over_base": statistics.median(rates["swapped"]) / statistics.median(rates["base"]),
            "adapter_bytes": adapter.num_bytes,
            "adapter_modules": len(adapter.modules),
            "swaps": swap_stats.num_swaps,
            "seconds_per_swap": swap_stats.swap_seconds / max(1, swap_stats.num_swaps),
            "initial_loads_all_resident": mixed_stats.num_swaps,
        })
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
