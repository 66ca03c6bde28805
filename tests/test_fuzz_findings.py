"""Bugs the schemathesis run (tests/test_server_fuzz.py) found outside this feature's modules.

The sampler turns valid but extreme parameters into inf/NaN probabilities and the request ends with a
500 ("generation failed"): a temperature or repetition_penalty so small that logits / it overflows
float32, and a top_p so small that it rounds to 0 in float32 and drops every token. Until the sampler
handles them, tests/schemathesis_hooks.py keeps fuzzed values above 1e-3; this test flips to XPASS
(and fails, being strict) once the sampler is fixed, so the hook's floor can go.
"""

import pytest
import torch

from llm_api.sampling import Sampler, SamplerBatch, SamplingParams, SamplingState


@pytest.mark.parametrize("params", [
    SamplingParams(do_sample=True, temperature=1.2e-296),
    SamplingParams(do_sample=True, top_p=5e-324),
    SamplingParams(do_sample=True, repetition_penalty=4.6e-197),
], ids=["temperature", "top_p", "repetition_penalty"])
@pytest.mark.xfail(strict=True, raises=RuntimeError, reason="sampler: inf/NaN probabilities for extreme valid parameters")
def test_sampler_survives_extreme_valid_parameters(params):
    logits = torch.randn(1, 64)
    token = Sampler()(logits, SamplerBatch([params], [SamplingState.for_params(params)], [[1, 2, 3]]))
    assert 0 <= int(token[0]) < 64
