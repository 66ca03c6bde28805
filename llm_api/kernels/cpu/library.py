"""The CPU kernels' shared library: built once per host from ``kernels.c`` and ``quant.c``, checked, loaded.

``load(cache_dir)`` compiles the C files with the system C compiler (``cc``) into
``<cache_dir>/cpu-kernels/<key>/``, ``key`` a hash of the sources, the compiler's version, the flags and the
CPU's flags (a library built on one host kind is never loaded on another), once per host: later starts load
it in milliseconds. No compiler, a failed build or a library that does not load: ``load`` logs why and
returns False, and the model keeps transformers' code (the fallback the tests also run); a model whose
weights are quantized cannot run without the library, and its loader says so before the server listens.

A library found in the cache is loaded only when it is this user's and no one else may write it or its
folder: the process maps it and runs its code, so a file another user could replace would run their code
in the server. One that is ours but does not load (a truncated file, a disk error) is removed and built
again, once. Processes building the same library at once (a TorchServe model's workers starting together, the
tests' workers) build it once: the first holds a lock on the build's folder while it compiles, the others
wait and then find the library there.

``build(..., sanitize=True)`` builds with AddressSanitizer and UndefinedBehaviorSanitizer (its own key): the
kernel tests run over it in a process that preloads the sanitizer's runtime (tests/kernels/test_sanitized.py),
so an out-of-bounds read of any kernel fails the suite.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (HERE / "kernels.c", HERE / "quant.c")
HEADERS = (HERE / "common.h", HERE / "quant.h")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
# -g1: line tables only, enough for the sanitizers' reports to name file and line; full -g took quant.c's compile
# from 26 to 37 s (gcc 12, the 2-core AMD host), most of a sanitized build's time in the suite.
SANITIZER_FLAGS = ("-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer",
                   "-g1")
LIBRARY_NAME = "libllm_api_cpu_kernels.so"
BUILD_TIMEOUT_S = 120
DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_library: ctypes.CDLL | None = None
_tried: dict[str, bool] = {}  # cache dir -> whether loading from it succeeded (one build per process)

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
SIGNATURES = {
    "llm_linear_f32": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int],
    "llm_linear_bf16": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int],
    "llm_rms_norm": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32, _int, _int],
    "llm_silu_and_mul": [_ptr, _i64, _ptr, _i64, _i64, _int, _int],
    "llm_rotary": [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int, _int],
    "llm_paged_decode": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64,
                         _i64, _i64, _f32, _i64, _int, _int],
    "llm_layer_in": [_ptr, _ptr, _ptr, _f32, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _f32, _f32, _ptr, _ptr, _i64,
                     _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _int, _int],
    "llm_layer_out": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _f32, _ptr, _ptr, _ptr, _ptr, _ptr, _f32, _ptr, _ptr, _i64,
                      _i64, _i64, _i64, _ptr, _ptr, _int, _int],
    "llm_greedy_pick": [_ptr, _i64, _i64, _i64, _ptr, _int, _int],
    "llm_use_amx": [_int],
    "llm_decode_layers": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64,
                          _ptr, _ptr, _int, _int],
    "llm_q_format": [_i64, _ptr, _ptr],
    "llm_q_dequantize": [_i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _int, _int],
    "llm_q_repack": [_i64, _ptr, _i64, _i64, _ptr, _int, _int],
    "llm_q_quantize": [_i64, _ptr, _i64, _i64, _ptr, _int],
    "llm_q_product": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int],
}


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def build_key(compiler: str, march: str = "native", sanitize: bool = False) -> str:
    """What the library depends on: the sources, the compiler's version, the flags, this CPU's flags."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    parts = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    for part in (*parts, version.encode(), " ".join(_flags(march, sanitize)).encode(), platform.machine().encode(),
                 real_cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _flags(march: str, sanitize: bool = False) -> list[str]:
    flags = [flag if flag != "-march=native" else f"-march={march}" for flag in FLAGS]
    return flags + list(SANITIZER_FLAGS) if sanitize else flags


def real_cpu_flags() -> str:
    """This CPU's flags, read from the kernel here (not through ``llm_api.model.cpu``, a layer above, whose
    file the tests may point at another host kind's: ``-march=native`` compiles for the real one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("flags", "Features"):
                return " ".join(sorted(value.split()))
    except OSError:
        pass
    return platform.processor()


def _private_folder(folder: Path) -> None:
    """Make ``folder`` and its parent (``cpu-kernels``) unwritable by others where they are this user's (a umask
    of 002 makes them group-writable; another user could then swap the library between check and load)."""
    for target in (folder.parent, folder):
        info = os.stat(target)
        if info.st_uid == os.getuid() and info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            os.chmod(target, stat.S_IMODE(info.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))


def untrusted(path: Path) -> str | None:
    """Why a library found at ``path`` must not be loaded (None: it is this user's, and neither it nor its folder
    is writable by anyone else)."""
    for target in (path, path.parent):
        info = os.stat(target)
        if info.st_uid != os.getuid():
            return f"{target} belongs to user {info.st_uid}, not to this one ({os.getuid()})"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{target} is writable by other users (mode {stat.filemode(info.st_mode)})"
    return None


def build(cache_dir: Path, march: str = "native", sanitize: bool = False) -> Path:
    """The library for this host under ``cache_dir`` (compiled now unless already there). Raises on failure,
    and on a cached library that ``untrusted`` refuses. ``march``: another target than this CPU (the tests build
    the AVX2 and plain x86-64 paths on any host); ``sanitize``: with the address and undefined-behaviour
    sanitizers."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    folder = Path(cache_dir) / "cpu-kernels" / build_key(compiler, march, sanitize)
    folder.mkdir(parents=True, exist_ok=True)
    _private_folder(folder)
    # (the lock file is opened without following a link: nobody else may write the folder, checked above)
    lock = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (another process building this library: wait, then take its build)
        return _cached_or_built(compiler, folder, march, sanitize)
    finally:
        os.close(lock)  # (closing releases the lock)


def _cached_or_built(compiler: str, folder: Path, march: str, sanitize: bool) -> Path:
    library = folder / LIBRARY_NAME
    if library.exists():
        reason = untrusted(library)
        if reason is not None:
            raise RuntimeError(f"refusing the cached CPU kernels: {reason}")
        return library
    # Built under a temporary name and renamed: a second process building at the same time never loads a
    # half-written file.
    fd, partial = tempfile.mkstemp(prefix=".building-", suffix=".so", dir=folder)
    os.close(fd)
    flags = _flags(march, sanitize)
    compiles: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix=".objects-", dir=folder) as objects:
        try:
            # Each source compiled by its own process, side by side (quant.c alone takes ~9 s on a 2-core host),
            # then linked.
            outputs = [str(Path(objects) / f"{source.stem}.o") for source in SOURCES]
            compiles = [subprocess.Popen([compiler, *flags, "-I", str(HERE), "-c", "-o", output, str(source)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                        for source, output in zip(SOURCES, outputs)]
            errors = [(c.communicate(timeout=BUILD_TIMEOUT_S)[1], c.returncode) for c in compiles]
            failed = [f"{compiler} failed ({code}): {err.strip()[-2000:]}" for err, code in errors if code != 0]
            if not failed:
                done = subprocess.run([compiler, *flags, "-o", partial, *outputs, "-lm"], capture_output=True,
                                      text=True, timeout=BUILD_TIMEOUT_S)
                if done.returncode != 0:
                    failed.append(f"{compiler} failed to link ({done.returncode}): {done.stderr.strip()[-2000:]}")
            if failed:
                raise RuntimeError("; ".join(failed))
            os.chmod(partial, 0o755)
            os.replace(partial, library)
        finally:
            for compile_process in compiles:
                if compile_process.poll() is None:
                    compile_process.kill()
            if os.path.exists(partial):
                os.unlink(partial)
    return library


def bind(path: Path) -> ctypes.CDLL:
    """The library at ``path``, its functions' signatures declared."""
    library = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int
    return library


def _build_and_bind(cache_dir: Path) -> tuple[Path, ctypes.CDLL]:
    path = build(cache_dir)
    try:
        return path, bind(path)
    except (OSError, AttributeError) as error:  # (ours, checked, but unloadable: removed and built once more)
        logger.warning("the cached CPU kernels at %s did not load (%s): building them again", path, error)
        path.unlink(missing_ok=True)
        path = build(cache_dir)
        return path, bind(path)


def load(cache_dir: Path | str) -> bool:
    """Build (once per host) and load the library; False, logged, where that cannot be done."""
    global _library
    key = str(cache_dir)
    if _library is not None:
        return True
    if key in _tried:
        return _tried[key]
    try:
        path, library = _build_and_bind(Path(cache_dir))
    except Exception as error:  # (no compiler, a failed build, a library that does not load: eager code runs)
        logger.warning("CPU kernels not available, transformers' code runs instead: %s", error)
        _tried[key] = False
        return False
    _library = library
    _tried[key] = True
    logger.info("CPU kernels loaded from %s", path)
    return True


def loaded() -> bool:
    return _library is not None


def lib() -> ctypes.CDLL:
    if _library is None:
        raise RuntimeError("llm_api.kernels.cpu: load() the library first")
    return _library


def threads() -> int:
    return torch.get_num_threads()
