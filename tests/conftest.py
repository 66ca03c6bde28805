"""Shared fixtures: the embedded model (prepared once, cached outside git) and real TorchServes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llm_api.config import default_model_path
from llm_api.embedded_model import prepare

MARKER = "<|endoftext|>"

CLASSIC_CONFIG = """\
minWorkers: 1
maxWorkers: 1
batchSize: 8
maxBatchDelay: 50
responseTimeout: 120
"""

# One handle() call gets exactly the four requests a test sends at once.
BATCH4_CONFIG = """\
minWorkers: 1
maxWorkers: 1
batchSize: 4
maxBatchDelay: 5000
responseTimeout: 120
"""


@pytest.fixture(scope="session")
def embedded_model_path() -> Path:
    return prepare(Path(os.environ["MODEL_PATH"]) if os.environ.get("MODEL_PATH") else default_model_path(os.environ))


@pytest.fixture(scope="session")
def embedded_lm(embedded_model_path):
    """The embedded model loaded the way the server loads it by default (bf16, CPU)."""
    from llm_api import model_loader
    from llm_api.config import Settings

    return model_loader.load(Settings.from_env({"MODEL_PATH": str(embedded_model_path)}))


def _serve(tmp_path_factory, embedded_model_path, name: str, model_config: str | None, **kw):
    from llm_api.local_server import TorchServe

    env = {"MODEL_PATH": str(embedded_model_path), **kw.pop("env", {})}
    server = TorchServe(tmp_path_factory.mktemp(name), model_config=model_config, env=env, **kw)
    try:
        server.start()
    except Exception:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def classic_server(tmp_path_factory, embedded_model_path):
    """Classic batching (batchSize 8), archive built as a .mar file."""
    server = _serve(tmp_path_factory, embedded_model_path, "classic", CLASSIC_CONFIG, mar=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def batch4_server(tmp_path_factory, embedded_model_path):
    server = _serve(tmp_path_factory, embedded_model_path, "batch4", BATCH4_CONFIG)
    yield server
    server.stop()
