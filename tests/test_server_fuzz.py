"""Fuzz the HTTP API described by docs/openapi.yaml against a live server: no 5xx, and it still serves."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llm_api.client import HTTPClient

pytestmark = pytest.mark.server
REPO = Path(__file__).resolve().parent.parent


def test_schemathesis_finds_no_server_error(async_server, tmp_path):
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks", "PYTHONPATH": str(REPO)}
    cmd = [
        str(Path(sys.executable).parent / "schemathesis"), "run", str(REPO / "docs" / "openapi.yaml"),
        "--url", async_server.http, "--header", f"Authorization: Bearer {async_server.key()}",
        "--checks", "not_a_server_error", "--phases", "examples,fuzzing", "--max-examples", "8",
        "--seed", "6", "--workers", "1", "--request-timeout", "60", "--max-time", "50",
        "--report-dir", str(tmp_path),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-12000:] + run.stderr[-2000:]
    assert async_server.worker_status() == "READY"
    http = HTTPClient(async_server.http, "smollm2", async_server.key())
    assert "Paris" in http.generate({"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_new_tokens": 24})
