"""The code is clean under the linter CI runs (ruff, configured in pyproject.toml: pyflakes, pycodestyle,
bugbear). A new unused import, undefined name or bare mistake fails here with ruff's own report."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
