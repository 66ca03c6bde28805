"""The host's memory as a server process sees it: how much there is, and giving freed heap back.

``host_memory_bytes()`` is the physical memory this process may use: ``MemTotal`` from ``/proc/meminfo``, or
the memory limit of its cgroup where that is lower (a container). It sizes the default CPU KV pool
(``llm_api.engine.kv_cache.choose_num_blocks``): a figure of the machine, not of the moment, so every start
on one host gets the same pool whatever its neighbours hold.

``release_freed_heap()`` asks glibc to return the free pages of its heaps to the kernel (``malloc_trim``).
Why: loading a model frees as much as it keeps (the checkpoint's tensors converted to DTYPE, the row-major
weights that ``llm_api.model.packed_linear`` replaces), and glibc keeps freed memory in its heaps for reuse:
its threshold for giving large blocks their own mapping rises to the size of every large block freed, so
after the first few frees the weights' copies land in the heap and stay resident when freed. Measured on a
2-core AMD EPYC (avx2), the embedded model in float32 with packed weights: 1,475 MB resident after loading,
1,076 MB after the trim. A no-op where the C library has no ``malloc_trim`` (musl, macOS).

``release_unreferenced_file_pages(model)`` drops from this process's resident set the pages of a checkpoint's
file mapping that no weight reads any more. transformers maps a safetensors file (private, copy on write) and a
weight loaded in the file's dtype is a view of its pages; when the engine merges q/k/v and gate/up
(``llm_api.models.linear.merge``) the merged copies are new memory and the originals are no longer referenced,
but the pages the copy read stay resident in the mapping for as long as the file is mapped, which is as long as
any of its other weights (o_proj, down, the embeddings) live. In each mapping of a checkpoint file that holds
some of the model's weights, every range that no parameter's or buffer's storage covers is handed back with
``madvise(MADV_DONTNEED)`` (whole pages only); the weights still read from the file stay where they are (shared
with the page cache and with other processes mapping the same file). Measured on the 2-core AMD EPYC (avx2),
the embedded float32 checkpoint (513 MiB) loaded as float32: a standalone server after three chats holds 247
MiB of the file's pages (its live weights) and 997 MiB in all, where without the release the whole file was
resident (513 MiB) and 1,252 MiB in all; a model of Llama-3.2-1B's shape in bfloat16 (2.36 GiB of safetensors,
``scripts/llama_1b_shape.py``), 2,825 MiB in all against 4,038 MiB (the file's pages 1,141 against 2,357 MiB). A
page given back and read again would come from the file (its original bytes), so only ranges that no weight of
the model covers are given back: a tensor written in place and kept outside the model is the one case it would
change, and the engine keeps none. Linux only; elsewhere, and where ``madvise`` is missing, nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
MAPS = Path("/proc/self/maps")
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # (the files transformers may map weights from)
# cgroup v2, then v1: the limit of the cgroup this process is in (read at the root of its mount, which is
# what a container sees as its own).
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
MADV_DONTNEED = 4  # (Linux's value on every architecture it runs torch on)
FALLBACK_BYTES = 8 << 30  # where neither can be read (not Linux): a small machine's memory


def host_memory_bytes() -> int:
    """Physical memory this process may use, in bytes (module docstring)."""
    total = 0
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    total = total or FALLBACK_BYTES
    for path in CGROUP_LIMITS:
        try:
            raw = path.read_text().strip()
        except OSError:
            continue
        if raw.isdigit():  # ("max" in v2, or a page-rounded huge number in v1, means no limit)
            total = min(total, int(raw))
    return total


def release_freed_heap() -> None:
    """Give glibc's free heap pages back to the kernel (module docstring); quietly nothing elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def _file_mappings(suffixes: tuple[str, ...]) -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of files whose names end with one of ``suffixes``."""
    found: list[tuple[int, int]] = []
    try:
        lines = MAPS.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith(suffixes):
            start, end = fields[0].split("-")
            found.append((int(start, 16), int(end, 16)))
    return found


def _live_ranges(model: nn.Module) -> list[tuple[int, int]]:
    """The byte ranges of every parameter's and buffer's whole storage, sorted."""
    ranges = set()
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type == "cpu" and tensor.layout == torch.strided:
            storage = tensor.untyped_storage()
            if storage.nbytes():
                ranges.add((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return sorted(ranges)


def _dead_pages(start: int, end: int, live: list[tuple[int, int]], page: int) -> list[tuple[int, int]]:
    """The whole pages of [start, end) that no live range touches."""
    gaps, cursor = [], start
    for low, high in live:
        if high <= cursor or low >= end:
            continue
        if low > cursor:
            gaps.append((cursor, low))
        cursor = max(cursor, high)
    if cursor < end:
        gaps.append((cursor, end))
    pages = []
    for low, high in gaps:
        low, high = -(-low // page) * page, high // page * page  # (inward: a page a live range shares is kept)
        if high > low:
            pages.append((low, high))
    return pages


def release_unreferenced_file_pages(model: nn.Module, suffixes: tuple[str, ...] = CHECKPOINT_SUFFIXES) -> int:
    """Give back the resident pages of checkpoint file mappings that no weight of ``model`` covers (module
    docstring); returns the bytes advised (resident or not)."""
    mappings = _file_mappings(suffixes)
    if not mappings:
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError, TypeError):
        return 0
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    live, page, advised = _live_ranges(model), mmap.PAGESIZE, 0
    # (only the mappings this model reads weights from: another model's file, an adapter's, is not its to judge)
    mappings = [(start, end) for start, end in mappings if any(low < end and high > start for low, high in live)]
    for start, end in mappings:
        for low, high in _dead_pages(start, end, live, page):
            if madvise(low, high - low, MADV_DONTNEED) == 0:
                advised += high - low
            else:
                logger.debug("madvise(%#x, %d) failed: %s", low, high - low, os.strerror(ctypes.get_errno()))
    if advised:
        logger.info("released %.0f MiB of the checkpoint's file mapping that no weight reads any more (merged or "
                    "converted copies replaced them)", advised / 2**20)
    return advised
