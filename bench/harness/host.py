"""What a benchmark's figures were measured on, described the same way by every script.

``cpu_model()`` is the CPU's ``model name`` from /proc/cpuinfo (``platform``'s processor or machine where
there is none). ``cpu_flags()`` is the part of ``CPU_FLAGS`` this CPU has, in that order: the feature words
that decide which kernels torch and llama.cpp run (bfloat16 matrix instructions or not, AVX-512 or AVX2).
``describe()`` gathers both with the core count, the torch version and torch's thread count, for a JSON
report; ``summary()`` is the same as one line for a script's first printed line.
"""

from __future__ import annotations

import os
import platform
from typing import Any

CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_model() -> str:
    from llm_api.model.cpu import cpu_model_name

    return cpu_model_name() or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    from llm_api.model.cpu import this_cpu_features

    features = this_cpu_features()
    return [flag for flag in CPU_FLAGS if flag in features]


def describe() -> dict[str, Any]:
    import torch

    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def summary() -> str:
    host = describe()
    flags = " ".join(host["cpu_flags"]) or "none of " + " ".join(CPU_FLAGS)
    return (f"CPU {host['cpu']}, {host['cores']} cores, flags: {flags}; torch {host['torch']}, "
            f"{host['threads']} threads")
