"""End to end on the real embedded model (SmolLM2-135M, loaded in float32): engine greedy == generate."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_engine_idle, greedy, make_engine

CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences what a hash table is.",
    "List three prime numbers.",
]
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def fp32_models(embedded_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path)
    def load():
        return AutoModelForCausalLM.from_pretrained(embedded_model_path, dtype=torch.float32).eval()

    return tokenizer, load(), load()  # (tokenizer, engine's model, generate()'s model)


def test_chat_prompts_match_generate(fp32_models):
    tokenizer, model, reference_model = fp32_models
    eos_token_ids = {tokenizer.eos_token_id}
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for text in CHATS]
    engine = make_engine(model, eos_token_ids=eos_token_ids, block_size=16, num_blocks=64)
    tokens = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts[:2]):
        engine.add_request(str(i), prompt, greedy(MAX_NEW_TOKENS))
    step = 0
    while engine.has_unfinished_requests():
        if step == 3:  # the others arrive while the first two are decoding
            for i, prompt in enumerate(prompts[2:], start=2):
                engine.add_request(str(i), prompt, greedy(MAX_NEW_TOKENS))
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        step += 1
    assert_engine_idle(engine)

    for i, prompt in enumerate(prompts):
        input_ids = torch.tensor([prompt])
        with torch.inference_mode():
            expected = reference_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                                max_new_tokens=MAX_NEW_TOKENS, eos_token_id=list(eos_token_ids),
                                                pad_token_id=tokenizer.eos_token_id)[0, len(prompt):].tolist()
        assert tokens[str(i)] == expected, (CHATS[i], tokenizer.decode(tokens[str(i)]), tokenizer.decode(expected))
