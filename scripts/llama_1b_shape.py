#!/usr/bin/env python3
"""Write a Hugging Face checkpoint of Llama-3.2-1B's shape with random weights, for benchmarks at 1B scale
(scripts/build_llamacpp.sh runs it with BUILD_1B=1; the weights are not a model of anything).

    .venv/bin/python scripts/llama_1b_shape.py --tokenizer-from ~/.cache/llm_api/models/SmolLM2-135M-Instruct OUT

The configuration is Llama-3.2-1B's: hidden 2048, 16 layers, 32 attention heads over 8 KV heads of 64,
intermediate 8192, vocabulary 128,256, tied embeddings, RoPE theta 500,000 (no rope scaling: its
llama3 scaling only changes positions past 8,192), RMSNorm eps 1e-5, bfloat16. The weights are drawn from
N(0, 0.02) (the config's initializer_range, the scale of a trained model's projections) with a fixed
``--seed``, in order of the parameters' names; the norms are ones. The tokenizer is copied from
``--tokenizer-from`` (the embedded SmolLM2's: 49,152 tokens, fewer than the 128,256 rows: the ids past it are
never produced by the tokenizer, and llama.cpp's converter pads its vocabulary with [PAD<i>] tokens), with
its BOS/EOS/PAD ids in the config.

Memory: the model is built on the meta device and materialized once in bfloat16 (2.5 GB), filled in place,
and saved with ``save_pretrained`` (safetensors), so at most about two copies of the weights are held.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def llama_1b_config(source: Path):
    from transformers import LlamaConfig

    ids = json.loads((source / "config.json").read_text())
    return LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False, initializer_range=0.02, dtype="bfloat16",
        bos_token_id=ids.get("bos_token_id"), eos_token_id=ids.get("eos_token_id"), pad_token_id=ids.get("pad_token_id"))


def random_model(config, seed: int):
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # (the tied lm_head is the embedding: listed once)
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, config.initializer_range, generator=generator)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "embeddings not tied"
    return model


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the checkpoint folder to write (must not exist)")
    parser.add_argument("--tokenizer-from", required=True, help="a checkpoint whose tokenizer files are copied")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out, source = Path(args.out), Path(args.tokenizer_from)
    if out.exists():
        parser.error(f"{out} exists")
    from transformers import AutoTokenizer

    config = llama_1b_config(source)
    model = random_model(config, args.seed)
    count = sum(p.numel() for p in model.parameters())
    print(f"llama_1b_shape: {count / 1e9:.3f} B parameters, seed {args.seed}; saving to {out}", flush=True)
    model.save_pretrained(out)
    del model
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    for path in out.iterdir():
        path.chmod(0o644)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
