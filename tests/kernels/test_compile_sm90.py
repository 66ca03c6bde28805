"""The kernels compile for an H100 (sm_90) through Triton's real compiler, with no register spills.

The interpreter tests check the kernels' arithmetic; this checks what only compiling can: that the
code lowers for Hopper (dot shapes, layouts, constexpr branches) and fits in registers at the default
tile sizes. On a GPU machine the other tests compile and run the kernels for real, so this is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

SCRIPT = Path(__file__).with_name("compile_sm90.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernel tests compile and run them for real")
def test_kernels_compile_for_sm90_without_spills():
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this triton build ships no NVIDIA backend tools")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    kernels = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(kernels) == 10
    for kernel in kernels:
        assert kernel["spill_bytes"] == 0, kernel
