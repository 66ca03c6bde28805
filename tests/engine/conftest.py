"""Fixtures for engine tests (helpers live in engine_helpers.py)."""

import pytest


@pytest.fixture(scope="module")
def tiny_models():
    """arch -> model, built once per module. Each test builds its own engine (which switches the model's
    attention to the paged one); ``reference_greedy`` switches a copy's back for generate()."""
    return {}
