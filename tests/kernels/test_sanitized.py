"""The CPU kernels under AddressSanitizer and UndefinedBehaviorSanitizer: the kernel tests run again over
sanitized builds, so an out-of-bounds access, a use after free or undefined behaviour in any kernel fails
the suite; and a check that a failed allocation inside ``paged_decode`` is an error, not a crash.

``test_the_kernel_tests_pass_under_the_sanitizers`` builds the library with ``library.build(...,
sanitize=True)`` into the host's build cache, under a key of their own that the servers never load
(``-march=native`` and plain ``x86-64``, the scalar C; and ``x86-64-v3`` too where native is not AVX2's code, a
CPU with AVX-512), then starts a pytest over
tests/kernels/test_cpu_kernels.py, test_quant_kernels.py and test_kernel_sweep.py with the sanitizers'
runtime preloaded (``LD_PRELOAD``: gcc's libasan, then libubsan; the library is loaded by a Python that was
not linked with them) and ``LLM_API_CPU_KERNELS_SANITIZED=1`` (tests/kernels/conftest.py: every build those
tests ask for is the sanitized one, from the same cache). ASan stops at the first error
(``halt_on_error``, ``abort_on_error``; ``detect_leaks=0``: CPython keeps memory until exit by design), and
so does UBSan (``-fno-sanitize-recover``, ``halt_on_error``); pytest leaves stderr uncaptured
(``--capture=sys``) so their reports reach the output this test shows. ``-k`` leaves out
``test_the_library_is_built_once_per_host_and_reused`` (a plain build, ~12 s, no kernel call) and runs
four of the sweep's 18 shapes per test (heads of 64/80/128 values, groups of 1/4/8, 1 and 16 rows: see
``SWEEP``), every dtype and weight kind of them. That still calls every function the library exports:
``llm_linear_f32``, ``llm_linear_bf16`` (test_products), ``llm_rms_norm`` (test_norms), ``llm_silu_and_mul``,
``llm_rotary``, ``llm_paged_decode`` (test_paged_decode_stores_and_attends and the sweep, a group above 64
included), ``llm_greedy_pick``, ``llm_use_amx``, ``llm_layer_in``, ``llm_layer_out``, ``llm_decode_layers``
(the sweep, dense and quantized), ``llm_q_format`` (the sweep), ``llm_q_dequantize``, ``llm_q_repack``,
``llm_q_quantize`` and ``llm_q_product`` (test_quant_kernels). Measured on the 2-core AMD host: ~2 min
when the sources changed since the last run, most of it the two sanitized builds (quant.c under ASan + UBSan,
~40 s at -O1); ~75 s of tests when the host's cache holds them.

``test_an_out_of_bounds_read_is_caught`` proves the job can fail: ``llm_q_dequantize`` called through ctypes
(past the Python checks) on blocks a row shorter than the call says, malloc'd where ASan sees their end,
must die with ASan's heap-buffer-overflow report naming the function.

Both skip, saying why, where the C compiler is not gcc with its libasan and libubsan, and inside the
sanitized run itself.

``test_a_failed_allocation_in_paged_decode_is_a_memory_error`` needs no sanitizer: a plain build in a process
whose malloc fails on request (a preloaded shim), where kernels.c's paged attention must return its
out-of-memory code (MemoryError) rather than write through a NULL pointer (a crash before the check existed).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llm_api.kernels.cpu import library as cpu_library
from tests.kernels.conftest import build_cache

REPO = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ["tests/kernels/test_cpu_kernels.py", "tests/kernels/test_quant_kernels.py",
                "tests/kernels/test_kernel_sweep.py"]
# The sweep's shapes the sanitized run takes (its test ids): every head size, group, row count once.
SWEEP = ["d64-g1-rows16", "d80-g8-rows16", "d128-g4-rows16", "d80-g4-rows1-"]
SELECTION = ("not built_once_per_host and (not (paged_decode_sweep or decoder_layers_sweep) or "
             + " or ".join(SWEEP) + ")")
ASAN_OPTIONS = "detect_leaks=0:abort_on_error=1:halt_on_error=1"
UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1"
RUN_TIMEOUT_S = 900
TAIL = 6000  # characters of the run's output shown on failure


def _runtime() -> tuple[str, list[str]]:
    """The compiler the library is built with, and the sanitizers' runtime to preload (ASan's first); skips
    where there is none."""
    if os.environ.get("LLM_API_CPU_KERNELS_SANITIZED") == "1":
        pytest.skip("already inside the sanitized run")
    compiler = cpu_library._compiler()
    if compiler is None:
        pytest.skip("no C compiler: the CPU kernels are not built")
    runtime = []
    for name in ("libasan.so", "libubsan.so"):
        found = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True,
                               timeout=30).stdout.strip()
        if not os.path.isabs(found) or not os.path.exists(found):
            pytest.skip(f"{compiler} has no {name} (the sanitizers' runtime; gcc's packages libasan8 and libubsan1)")
        runtime.append(os.path.realpath(found))
    return compiler, runtime


def _marches() -> list[str]:
    """native and the scalar x86-64, and x86-64-v3 (AVX2) where native's vector paths are AVX-512's."""
    flags = set(cpu_library.real_cpu_flags().split())
    return ["native", *(["x86-64-v3"] if "avx512f" in flags else []), "x86-64"]


@pytest.fixture(scope="module")
def sanitized() -> tuple[Path, list[str], list[str]]:
    """(the cache holding the sanitized builds, the marches built, the runtime to preload). The host's build cache
    (tests/kernels/conftest.py's ``build_cache``: keyed by the sources and flags, so only a changed source is
    compiled again, ~90 s of the suite's time on a 2-core host when it is)."""
    _, runtime = _runtime()
    cache = build_cache()
    marches = _marches()
    for march in marches:
        cpu_library.build(cache, march, sanitize=True)
    return cache, marches, runtime


def _environment(runtime: list[str], **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(LD_PRELOAD=" ".join(runtime), ASAN_OPTIONS=ASAN_OPTIONS, UBSAN_OPTIONS=UBSAN_OPTIONS, **extra)
    return env


def _tail(done: subprocess.CompletedProcess) -> str:
    """The end of a run's output, and how it ended (a negative code: killed by that signal, a crash)."""
    return f"exit {done.returncode}; the output's end:\n" + (done.stdout + (done.stderr or ""))[-TAIL:]


def test_the_kernel_tests_pass_under_the_sanitizers(sanitized):
    cache, marches, runtime = sanitized
    env = _environment(runtime, LLM_API_CPU_KERNELS_SANITIZED="1", LLM_API_CPU_KERNELS_CACHE=str(cache),
                       LLM_API_CPU_KERNELS_BUILDS=",".join(marches))
    command = [sys.executable, "-m", "pytest", "-v", "-x", "-p", "no:cacheprovider", "--capture=sys", "-k", SELECTION,
               *KERNEL_TESTS]  # (-v: the last test named is the one a sanitizer stopped)
    done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, (f"the kernel tests failed under the sanitizers (exit {done.returncode}; "
                                  f"builds {marches}):\n{_tail(done)}")
    assert " passed" in done.stdout, _tail(done)


OVERFLOW = r"""
import ctypes, sys
import torch
from llm_api.kernels.cpu import library, quant

lib = library.bind(sys.argv[1])
fmt, rows, k = quant.FORMATS["Q8_0"], 4, 64
size = fmt.row_bytes(k) * (rows - 1)  # a row short of what the call says
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
blocks = libc.malloc(size)  # (ASan's malloc: the runtime is preloaded)
ctypes.memset(blocks, 0, size)
out = torch.empty(rows, k)
lib.llm_q_dequantize(fmt.type_id, 0, blocks, rows, None, rows, k, out.data_ptr(), k, 0, 1)
print("the read past the blocks went unnoticed")
"""


def test_an_out_of_bounds_read_is_caught(sanitized):
    cache, _, runtime = sanitized
    library = cpu_library.build(cache, "native", sanitize=True)
    done = subprocess.run([sys.executable, "-c", OVERFLOW, str(library)], cwd=REPO, env=_environment(runtime),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "unnoticed" not in done.stdout, _tail(done)
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in done.stderr, _tail(done)
    assert "llm_q_dequantize" in done.stderr, _tail(done)


# ------------------------------------------------------------------------------------------------------
# A failed allocation inside a kernel: an error (MemoryError), not a crash

# malloc, failing on request: the calls of one size, after `skip` of them, `count` times (then malloc again).
FAILING_MALLOC = r"""
#include <stddef.h>
extern void *__libc_malloc(size_t);
static size_t fail_size;
static int fail_skip, fail_count;
void failing_malloc_arm(size_t size, int skip, int count) { fail_size = size; fail_skip = skip; fail_count = count; }
void *malloc(size_t size) {
    if (size == fail_size && fail_count > 0) {
        if (fail_skip > 0) fail_skip--;
        else { fail_count--; return NULL; }
    }
    return __libc_malloc(size);
}
"""

# paged_decode with 77 query heads over one key/value head: the kernel mallocs the group's maxima and sums
# (77 floats each, 308 bytes; the step's scratch is larger) where a group is above 64. Each failure case:
# (mallocs of 308 bytes let through first, how many fail): the maxima's, the sums', both.
GROUP_ALLOCATIONS = r"""
import ctypes, sys
import torch
from llm_api.kernels import cpu
from llm_api.kernels.cpu import library

library._library = library.bind(sys.argv[1])
arm = ctypes.CDLL(None).failing_malloc_arm
arm.argtypes, arm.restype = [ctypes.c_size_t, ctypes.c_int, ctypes.c_int], None
generator = torch.Generator().manual_seed(0)
heads, dim = 77, 16
key_cache, value_cache = (torch.randn(4, 16, 1, dim, generator=generator) for _ in range(2))
query, key, value = (torch.randn(1, n, generator=generator) for n in (heads * dim, dim, dim))
slots, tables, lengths = torch.tensor([40]), torch.tensor([[2, 0, 3, 1]]), torch.tensor([41])
call = lambda: cpu.paged_decode(query, key, value, key_cache, value_cache, slots, tables, lengths, 0.25)
expected = call()  # (and the threads' pool made before any malloc fails)
for skip, count in ((0, 1), (1, 1), (0, 2)):
    arm(heads * 4, skip, count)
    try:
        call()
        print("no error", skip, count)
    except MemoryError as error:
        print("MemoryError", skip, count, error)
    finally:
        arm(0, 0, 0)
print("after", torch.equal(call(), expected))
"""


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):
        return False


@pytest.mark.skipif(cpu_library._compiler() is None or not _glibc(),
                    reason="needs a C compiler and glibc (the shim calls glibc's __libc_malloc)")
def test_a_failed_allocation_in_paged_decode_is_a_memory_error(kernel_libraries, tmp_path):
    """kernels.c's paged attention returns 1 (MemoryError in Python) where a malloc of the group's maxima or
    sums fails, and frees what it had; the next call computes as before (a process whose malloc fails on
    request: a preloaded shim, in a plain build)."""
    compiler = cpu_library._compiler()
    shim = tmp_path / "failing_malloc.so"
    source = tmp_path / "failing_malloc.c"
    source.write_text(FAILING_MALLOC)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(shim), str(source)], check=True, timeout=60)
    library = cpu_library.build(kernel_libraries.cache, "native")
    env = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    env["LD_PRELOAD"] = str(shim)
    done = subprocess.run([sys.executable, "-c", GROUP_ALLOCATIONS, str(library)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, _tail(done)
    lines = done.stdout.splitlines()
    assert [line.split(" out of")[0] for line in lines[:3]] == [
        "MemoryError 0 1 paged_decode:", "MemoryError 1 1 paged_decode:", "MemoryError 0 2 paged_decode:"], _tail(done)
    assert lines[3] == "after True", _tail(done)
