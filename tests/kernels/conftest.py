"""What the CPU kernels' tests share: the library's builds (``kernel_libraries``), one set per test session.

The kernel tests (tests/kernels/test_cpu_kernels.py, test_quant_kernels.py, test_kernel_sweep.py) run every
check on three builds of ``llm_api.kernels.cpu``: ``-march=native``, ``x86-64-v3`` (AVX2 + FMA, where the CPU
runs it) and plain ``x86-64`` (the scalar C). Their ``libraries`` fixtures take them from here, built once a
session into a temporary cache.

The sanitizer hook: with ``LLM_API_CPU_KERNELS_SANITIZED=1`` in the environment, every build is made with
``library.build(..., sanitize=True)`` (AddressSanitizer and UndefinedBehaviorSanitizer), so any out-of-bounds
access or undefined behaviour in a kernel aborts the test process. The process must then have the sanitizer's
runtime preloaded (``LD_PRELOAD=<gcc -print-file-name=libasan.so> <... libubsan.so>``: ASan's runtime first):
tests/kernels/test_sanitized.py starts such a pytest. ``LLM_API_CPU_KERNELS_CACHE=<folder>`` puts the builds
there instead (a cache shared with the process that started this one, which has built them already; otherwise
the builds go to the host's build cache, the one the servers use: ``build_cache``), and
``LLM_API_CPU_KERNELS_BUILDS=native,x86-64`` (a comma-separated list) offers only those builds: the tests of the
others skip.
Nothing here changes what the server builds or loads.

Every kernel test runs with two torch threads (``kernel_threads``), whatever the process was started with: the
kernels take their thread count from torch, and how they split rows, heads and blocks across threads is part of
what these tests check, where scripts/test.sh starts the suite with one thread a process.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from llm_api.kernels.cpu import library as cpu_library
from llm_api.model.settings import default_cache_dir

SANITIZED_ENV = "LLM_API_CPU_KERNELS_SANITIZED"
CACHE_ENV = "LLM_API_CPU_KERNELS_CACHE"
BUILDS_ENV = "LLM_API_CPU_KERNELS_BUILDS"
BUILDS = ("native", "x86-64-v3", "x86-64")


@pytest.fixture(autouse=True)
def kernel_threads(two_threads) -> None:
    """Every kernel test with two torch threads (tests/conftest.py's ``two_threads``)."""


def sanitized() -> bool:
    """Whether this process's kernel tests run over the sanitized builds (``LLM_API_CPU_KERNELS_SANITIZED=1``)."""
    return os.environ.get(SANITIZED_ENV, "") == "1"


def host_runs(march: str) -> bool:
    """This CPU runs code built for ``march`` (x86-64-v3 needs AVX2 and FMA; the others run anywhere here)."""
    return march != "x86-64-v3" or {"avx2", "fma"} <= set(cpu_library.real_cpu_flags().split())


def _asan_preloaded() -> bool:
    return any("libasan" in Path(entry).name for entry in os.environ.get("LD_PRELOAD", "").replace(":", " ").split())


class Builds(Mapping):
    """The builds this CPU runs, by march, each built (``library.build``) and bound (``library.bind``) the first
    time a test asks for it: a run that selects only native-build tests compiles only that one."""

    def __init__(self, cache: Path, sanitize: bool):
        self.cache, self.sanitize = cache, sanitize
        chosen = [m.strip() for m in os.environ.get(BUILDS_ENV, "").split(",") if m.strip()] or BUILDS
        self.marches = [march for march in BUILDS if host_runs(march) and march in chosen]
        self.bound: dict[str, ctypes.CDLL] = {}

    def __getitem__(self, march: str) -> ctypes.CDLL:
        if march not in self.marches:
            raise KeyError(march)
        if march not in self.bound:
            self.bound[march] = cpu_library.bind(cpu_library.build(self.cache, march, sanitize=self.sanitize))
        return self.bound[march]

    def __iter__(self) -> Iterator[str]:
        return iter(self.marches)

    def __len__(self) -> int:
        return len(self.marches)


@pytest.fixture(scope="session")
def kernel_libraries() -> Builds:
    """Each build this CPU runs (``Builds``); sanitized under ``LLM_API_CPU_KERNELS_SANITIZED=1``."""
    if sanitized() and not _asan_preloaded():
        pytest.fail(f"{SANITIZED_ENV}=1 needs AddressSanitizer's runtime preloaded: LD_PRELOAD=$(gcc "
                    "-print-file-name=libasan.so) (tests/kernels/test_sanitized.py)", pytrace=False)
    cache = Path(os.environ[CACHE_ENV]) if os.environ.get(CACHE_ENV) else build_cache()
    return Builds(cache, sanitized())


def build_cache() -> Path:
    """The host's build cache, the one the servers load their library from (``LLM_API_CACHE``, else
    ~/.cache/llm_api: ``cpu-kernels/<key>/``). A build's key hashes the sources, the compiler's version, the flags
    and the CPU (``library.build_key``), so a run compiles only the builds whose sources changed since the last
    run on this host, once, by the first worker that asks (``library.build`` locks a build's folder; the others
    wait for it). Every worker used to compile its own (~15-30 s of both cores each, six to eight builds a run),
    then one set a run into the run's temporary folder (~140 s of the suite's time on the 2-core AMD host,
    with the sanitized builds); the build itself is tested where it matters, on temporary caches
    (test_library.py, test_cpu_kernels.py's built-once test)."""
    return default_cache_dir()
