"""End to end on the real embedded model (SmolLM2-135M, loaded in float32): engine greedy == generate."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import EMBEDDED_CHATS, embedded_models, reference_greedy, run_embedded_chats

MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def fp32_models(embedded_checkpoint_path):
    return embedded_models(embedded_checkpoint_path, torch.float32)


def test_chat_prompts_match_generate(fp32_models):
    tokenizer, model, reference_model = fp32_models
    prompts, answers = run_embedded_chats(tokenizer, model, MAX_NEW_TOKENS)
    for text, prompt, got in zip(EMBEDDED_CHATS, prompts, answers):
        with torch.inference_mode():
            expected = reference_greedy(reference_model, prompt, MAX_NEW_TOKENS, tokenizer.eos_token_id)
        assert got == expected, (text, tokenizer.decode(got), tokenizer.decode(expected))
