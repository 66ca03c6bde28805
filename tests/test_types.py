"""The package and bench/ (the benchmarks and their harness) type-check clean under mypy (configured in
pyproject.toml: ``[tool.mypy]``, the generated gRPC stubs left out). A wrong annotation, an unchecked ``None`` or a call that does not fit its signature
fails here with mypy's own report."""

import subprocess
import sys
from pathlib import Path

from llm_api.model.settings import default_cache_dir

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_nothing():
    # No file arguments: mypy reads the files to check and its settings from pyproject.toml in the working
    # directory. Its cache lives in the user cache (beside the embedded model), not in the checkout: a fresh
    # clone (every CI run) then rechecks only what changed, each file's cached result validated by its hash,
    # instead of re-reading torch's stubs for a minute of the suite's 2 cores. One directory per mypy and
    # Python version.
    import mypy.version

    cache = default_cache_dir() / "mypy" / f"{mypy.version.__version__}-py{sys.version_info[0]}.{sys.version_info[1]}"
    result = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache)], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
