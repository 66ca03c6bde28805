"""The package and bench/ (the benchmarks and their harness) type-check clean under mypy (configured in
pyproject.toml: ``[tool.mypy]``, the generated gRPC stubs left out). A wrong annotation, an unchecked ``None`` or a call that does not fit its signature
fails here with mypy's own report."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_nothing():
    # No arguments: mypy reads the files to check and its settings from pyproject.toml in the working directory.
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
