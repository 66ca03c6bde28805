"""llm_api.kernels imports without Triton, and triton_usable says when the kernels can run."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import llm_api.kernels as kernels


def test_import_without_triton():
    # A fresh interpreter where `import triton` fails: the package still imports, says unusable, and the
    # kernels fail only when touched.
    code = (
        "import sys, torch\n"
        "sys.modules['triton'] = None\n"
        "import llm_api.kernels as k\n"
        "assert not k.triton_usable(torch.device('cuda'))\n"
        "try:\n"
        "    k.paged_decode_attention\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('expected ImportError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_triton_usable(monkeypatch):
    if not kernels._triton_importable():
        assert not kernels.triton_usable(torch.device("cuda"))
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.triton_usable(torch.device("cpu"))
    # The functions, not same-named submodules. (Touched while the interpreter is on: a kernel module
    # decorated without it could not run on CPU.)
    import llm_api.kernels.decode_attention  # noqa: F401  (a loaded submodule must not shadow them)
    import llm_api.kernels.kv_write  # noqa: F401

    for name in ("store_kv", "paged_decode_attention", "paged_prefill_attention"):
        assert callable(getattr(kernels, name)), name
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not kernels.triton_usable(torch.device("cpu"))
    assert kernels.triton_usable(torch.device("cuda"))
