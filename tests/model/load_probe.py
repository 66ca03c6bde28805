"""A model loaded in a fresh Python process, as a server's start loads it: what it became and which of the heavy
modules that loading imported (tests/model/test_gguf_model.py, test_checkpoint_model.py: our module tree and our
tokenizer must load without transformers, its model and config classes, and torch._dynamo and sympy, which they
import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# transformers, its modeling stack (a Qwen3 model's classes: the probes' tiny models are Qwen3) and what that imports.
HEAVY = ("transformers", "transformers.modeling_utils", "transformers.models.qwen3.modeling_qwen3",
         "transformers.models.qwen3.configuration_qwen3", "torch._dynamo", "sympy")


def load_in_a_fresh_process(env: dict[str, str]) -> tuple[str, list[str]]:
    """(the loaded model's class name, the HEAVY modules imported) for ``load(Settings.from_env(env))``."""
    probe = ("import json, sys; from llm_api.model.loader import load; from llm_api.model.settings import Settings; "
             f"lm = load(Settings.from_env({json.dumps(env)})); "
             f"print(json.dumps([type(lm.model).__name__, [m for m in {list(HEAVY)!r} if m in sys.modules]]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    name, modules = json.loads(out.stdout.splitlines()[-1])
    return name, modules
