"""Helpers for engine tests: tiny random decoders (fp32, seeded), the generate() oracle, drivers.

Every helper that runs requests through an engine ends with ``assert_engine_idle``: no request left and
every KV block free again, with the pool's invariants intact.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    PhiConfig,
    Qwen2Config,
    Qwen3Config,
    Starcoder2Config,
)

from llm_api.engine.engine import EngineConfig, LLMEngine
from llm_api.kernels import triton_usable
from llm_api.engine.sampling_params import SamplingParams
from llm_api.model.settings import default_cache_dir

# Where an engine given ``cpu_kernels_cache`` finds the CPU kernels' library: the host's build cache, the servers'
# (tests/kernels/conftest.py's ``build_cache``: keyed by the sources, flags and CPU). A temporary folder per test
# compiled the library again in each worker's first such engine (~15-30 s of both cores each).
KERNELS_CACHE = str(default_cache_dir())

# Engine tests of these CPU models through the Triton kernels run only under the interpreter (a GPU
# machine runs tests/engine/test_gpu_fast_path.py instead).
needs_cpu_triton = pytest.mark.skipif(not triton_usable(torch.device("cpu")),
                                      reason="Triton kernels on CPU need triton and TRITON_INTERPRET=1")

VOCAB_SIZE = 1000
_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=VOCAB_SIZE, max_position_embeddings=512)

TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON),
    # A window shorter than the longest context, so the sliding-window mask is exercised.
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=24),
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=16),
    "gpt2": lambda: GPT2Config(n_embd=64, n_layer=2, n_head=4, n_inner=128, vocab_size=VOCAB_SIZE, n_positions=512),
    # Gemma-2: alternating sliding/full layers, attention and final logit softcapping, its own query scale.
    "gemma2": lambda: Gemma2Config(**_COMMON, head_dim=16, sliding_window=24, attn_logit_softcapping=50.0,
                                   final_logit_softcapping=30.0, query_pre_attn_scalar=16, pad_token_id=0),
    # Gemma-3: q/k norms, a sliding layer pattern (5 local : 1 global, here 3 layers: 2 sliding + 1 full).
    "gemma3": lambda: Gemma3TextConfig(**{**_COMMON, "num_hidden_layers": 3}, head_dim=16, sliding_window=24,
                                       query_pre_attn_scalar=16, pad_token_id=0,
                                       layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    # Phi-3: fused qkv and gate_up projections. (Its default pad id is outside the tiny vocabulary.)
    "phi3": lambda: Phi3Config(**_COMMON, pad_token_id=0),
    # Phi-1/2: partial rotary embedding, parallel attention and MLP.
    "phi": lambda: PhiConfig(**_COMMON, partial_rotary_factor=0.5, pad_token_id=0),
    "gpt_neox": lambda: GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                      vocab_size=VOCAB_SIZE, max_position_embeddings=512, rotary_pct=0.5),
    # Granite: scaled embeddings, residuals, attention and logits (attention_multiplier is the scaling).
    "granite": lambda: GraniteConfig(**_COMMON, embedding_multiplier=2.0, residual_multiplier=0.5,
                                     attention_multiplier=0.2, logits_scaling=4.0, pad_token_id=0),
    "olmo2": lambda: Olmo2Config(**_COMMON, pad_token_id=0),
    "starcoder2": lambda: Starcoder2Config(**_COMMON, sliding_window=24),
}


def tiny_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[arch](), dtype=torch.float32)
    return model.eval()


def get_model(cache: dict, arch: str):
    if arch not in cache:
        cache[arch] = (tiny_model(arch), tiny_model(arch))  # (for the engine, for generate())
    return cache[arch]


def random_prompt(generator: torch.Generator, length: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (length,), generator=generator).tolist()


@torch.inference_mode()
def reference_greedy(model, prompt_token_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None):
    """generate() alone on one prompt (no padding), on the model's device: the token ids it appends, EOS included."""
    input_ids = torch.tensor([prompt_token_ids], device=next(model.parameters()).device)
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                            max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=0)
    return output[0, len(prompt_token_ids):].tolist()


def make_engine(model, eos_token_ids=(), lora=None, **config) -> LLMEngine:
    config.setdefault("block_size", 4)
    config.setdefault("num_blocks", 256)
    return LLMEngine(model, EngineConfig(**config), eos_token_ids=set(eos_token_ids), lora=lora)


def run_engine(engine: LLMEngine, arrivals: dict[int, list[tuple]], max_steps: int = 10_000):
    """arrivals: step index -> [(request_id, prompt_token_ids, SamplingParams)] added before that step.
    Returns request_id -> (generated token ids, finish reason) and checks the engine ends idle."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for step in range(max_steps):
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
            tokens[request_id] = []
        if step > max(arrivals) and not engine.has_unfinished_requests():
            break
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
            if output.finished:
                reasons[output.request_id] = output.finish_reason
    else:
        raise AssertionError("engine did not finish")
    assert_engine_idle(engine)
    return {rid: (tokens[rid], reasons.get(rid)) for rid in tokens}


def step_outputs(engine: LLMEngine, arrivals: dict[int, list[tuple]], steps: int) -> dict[str, list]:
    """``steps`` engine steps with ``arrivals`` as in ``run_engine``: request_id -> each step's (new token ids,
    logprobs), for comparing two engines step by step (every request must have finished)."""
    outputs: dict[str, list] = {}
    for step in range(steps):
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append((output.new_token_ids, output.logprobs))
    assert not engine.has_unfinished_requests()
    return outputs


def on_transformers_path(monkeypatch) -> None:
    """Engines built from here on run transformers' classes with the paged attention (the oracle of the owned
    decoder, llm_api.models), whatever the family."""
    from llm_api.engine import model_runner
    from llm_api.models.families import TRANSFORMERS, ModelPath

    monkeypatch.setattr(model_runner, "own_model", lambda model, kernels, merged=True: (
        None, ModelPath(TRANSFORMERS, "", "", "the test's oracle")))


def assert_engine_idle(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert not engine.has_unfinished_requests()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"
    engine.scheduler.block_pool.check_invariants({})


def greedy(max_new_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, do_sample=False, **kwargs)


# The embedded model (tests/engine/test_embedded_model.py in float32, test_bf16.py in bfloat16)

EMBEDDED_CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences what a hash table is.",
    "List three prime numbers.",
]


def embedded_models(path, dtype: torch.dtype):
    """The embedded model's tokenizer and two copies of the model in ``dtype``: the engine's and generate()'s."""
    from transformers import AutoTokenizer

    def load():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    return AutoTokenizer.from_pretrained(path), load(), load()


def run_embedded_chats(tokenizer, model, max_new_tokens: int):
    """EMBEDDED_CHATS through the engine greedily, two at first and the others joining at step 3 while those
    decode. Returns the prompts' token ids and each one's generated ids (by index)."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for text in EMBEDDED_CHATS]
    engine = make_engine(model, eos_token_ids={tokenizer.eos_token_id}, block_size=16, num_blocks=64)
    requests = [(str(i), prompt, greedy(max_new_tokens)) for i, prompt in enumerate(prompts)]
    results = run_engine(engine, {0: requests[:2], 3: requests[2:]})
    return prompts, [results[str(i)][0] for i in range(len(prompts))]


class Doubled(nn.Module):
    """A wrapper around a projection, put in after an engine started (as a LoRA wrapper is): its change (x 2)
    shows in the output only where the wrapper is called, not skipped by a merged or planned product."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base

    def forward(self, x):
        return 2 * self.base(x)
