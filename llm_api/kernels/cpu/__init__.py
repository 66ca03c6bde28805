"""CPU kernels for the fused decoder layers (``llm_api.engine.fused_layers``, issue 37): a decode step's
products of a few rows over both cores, and RMSNorm, the residual sum + norm, SiLU x up and the rotary
embedding each in one pass, with transformers' rounding; a Llama layer of such a step in two calls around
its attention (``layer_in``, ``layer_out``), a decode step's paged attention in one (``paged_decode``), and
a step's every layer in one (``decode_layers``); LoRA adapters' deltas inside those calls, each
row over its own adapter's columns (``LoraRows``, ``LoraProducts``); and a greedy step's argmax and
finiteness check in one pass (``greedy_pick``).

Why hand-written, and why C through ctypes. A batch-1 decode step on a 2-core CPU is ~60% weight products
and ~25% small per-layer ops (docs/benchmarks.md, "Where a CPU decode step goes"). torch runs a one-row
bfloat16 product at about half the memory's read rate (oneDNN's packed or not), and a one-row float32
product on one core where MKL is not the library's choice (AMD); the small ops are ~60 tensor ops a layer
at 3-20 us each, which a Python rewrite did not shorten. ``torch.compile`` fuses the small ops but took
153 s to compile (issue 37's probe), and its products are torch's. A C file of ~500 lines compiled with
``-march=native`` in about a second does both, and saves the Python between the ops: the products as
register tiles (up to 4 input rows x 4 weight rows, float32 sums in vector registers, AVX512-BF16
``vdpbf16ps`` where the CPU has it, AVX-512 or AVX2 FMA otherwise, scalar C elsewhere; bfloat16 products
of 2-16 rows on AMX tiles where the CPU has AMX, ``use_amx``) over blocks of weight rows split across
OpenMP threads (torch's own OpenMP runtime: the library resolves
``libgomp.so.1`` to the copy torch loaded), and each elementwise op as one loop. Plain C with raw
pointers rather than a torch extension: no torch headers to compile
(tens of seconds per build) and no ABI tied to a torch build.

The build: ``load(cache_dir)`` compiles ``kernels.c`` with the system C compiler (``cc``) into
``<cache_dir>/cpu-kernels/<key>/``, ``key`` a hash of the source, the compiler's version, the flags and the
CPU's flags (a library built on one host kind is never loaded on another), once per host: later starts
load it in milliseconds. No compiler, a failed build or a library that does not load: ``load`` logs why
and returns False, and the model keeps transformers' code (the fallback the tests also run).

The contract of each function is its Triton twin's (``llm_api.kernels.rms_norm``, ``.rotary``,
``.activation``, ``.gemv``), for float32 and bfloat16 tensors on the CPU; ``row_product`` takes at most
``max_rows(dtype)`` rows (``takes_product``), and larger inputs stay with ``F.linear``, whose library
products win there. Results: elementwise ops bit-identical to transformers' in float32 except the norm's
sum of squares and the SiLU's ``exp`` (their own order and libm: an ulp or two), products equal up to the
order of float32 sums; bfloat16 rounded once per op as there (tests/kernels/test_cpu_kernels.py).
The C side trusts its arguments (shapes, strides, block tables, slots): they come from the engine and the
model's own tensors, never from a request, and the wrappers here check what the engine does not fix.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
LIBRARY_NAME = "libllm_api_cpu_kernels.so"
BUILD_TIMEOUT_S = 120
# The most rows ``row_product`` takes, by dtype: above it the library's products (AMX or MKL tiles) won
# (bench/cpu_kernels.py; docs/benchmarks.md, "CPU kernels").
MAX_ROWS = {torch.float32: 16, torch.bfloat16: 16}
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
name = "CPU"  # (the kernel set's name in the log)

_library: ctypes.CDLL | None = None
_tried: dict[str, bool] = {}  # cache dir -> whether loading from it succeeded (one build per process)

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "llm_linear_f32": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int],
    "llm_linear_bf16": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int],
    "llm_rms_norm": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32, _int, _int],
    "llm_silu_and_mul": [_ptr, _i64, _ptr, _i64, _i64, _int, _int],
    "llm_rotary": [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int, _int],
    "llm_paged_decode": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64,
                         _i64, _i64, _f32, _int, _int],
    "llm_layer_in": [_ptr, _ptr, _ptr, _f32, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64,
                     _i64, _ptr, _ptr, _int, _int],
    "llm_layer_out": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _f32, _ptr, _ptr, _ptr, _ptr, _ptr, _f32, _ptr, _ptr, _i64,
                      _i64, _i64, _i64, _ptr, _ptr, _int, _int],
    "llm_greedy_pick": [_ptr, _i64, _i64, _i64, _ptr, _int, _int],
    "llm_use_amx": [_int],
    "llm_decode_layers": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64,
                          _ptr, _ptr, _int, _int],
}


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def build_key(compiler: str, march: str = "native") -> str:
    """What the library depends on: the source, the compiler's version, the flags, this CPU's flags."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.encode(), " ".join(_flags(march)).encode(), platform.machine().encode(),
                 _real_cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _flags(march: str) -> list[str]:
    return [flag if flag != "-march=native" else f"-march={march}" for flag in FLAGS]


def _real_cpu_flags() -> str:
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


def build(cache_dir: Path, march: str = "native") -> Path:
    """The library for this host under ``cache_dir`` (compiled now unless already there). Raises on failure.
    ``march``: another target than this CPU (the tests build the AVX2 and plain x86-64 paths on any host)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    folder = Path(cache_dir) / "cpu-kernels" / build_key(compiler, march)
    library = folder / LIBRARY_NAME
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: a second process building at the same time never loads a
    # half-written file.
    fd, partial = tempfile.mkstemp(prefix=".building-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_flags(march), "-o", partial, str(SOURCE), "-lm"], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return library


def bind(path: Path) -> ctypes.CDLL:
    """The library at ``path``, its functions' signatures declared."""
    library = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int
    return library


def load(cache_dir: Path | str) -> bool:
    """Build (once per host) and load the library; False, logged, where that cannot be done."""
    global _library
    key = str(cache_dir)
    if _library is not None:
        return True
    if key in _tried:
        return _tried[key]
    try:
        path = build(Path(cache_dir))
        library = bind(path)
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


def _lib() -> ctypes.CDLL:
    if _library is None:
        raise RuntimeError("llm_api.kernels.cpu: load() the library first")
    return _library


def _threads() -> int:
    return torch.get_num_threads()


def _on_cpu(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return (first.dtype in DTYPES and all(t.device.type == "cpu" and t.dtype == first.dtype for t in tensors))


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# ------------------------------------------------------------------------------------------------------
# The kernel set's interface (llm_api.engine.fused_layers.TRITON_KERNELS is the other one)

def takes(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and _library is not None


def max_rows(dtype: torch.dtype) -> int:
    return MAX_ROWS.get(dtype, 0)


def takes_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """``row_product`` computes ``F.linear(x, weight, bias)`` for these (a few rows, one dtype, plain weight)."""
    rows = x.numel() // max(1, x.shape[-1])
    return (_library is not None and 0 < rows <= max_rows(x.dtype) and weight.dim() == 2 and weight.is_contiguous()
            and _on_cpu(x, weight, *(() if bias is None else (bias,)))
            and (bias is None or bias.is_contiguous()))


def row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                silu_mul: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; with ``silu_mul``, ``F.linear(silu_and_mul(x), weight, bias)``."""
    if silu_mul:
        x = silu_and_mul(x)
    if not takes_product(x, weight, bias):
        return F.linear(x, weight, bias)
    rows = _rows(x)
    outputs, inputs = weight.shape
    if rows.shape[1] != inputs:
        raise ValueError(f"row_product: x has {rows.shape[1]} features, weight takes {inputs}")
    out = torch.empty((rows.shape[0], outputs), dtype=x.dtype)
    function = _lib().llm_linear_bf16 if x.dtype == torch.bfloat16 else _lib().llm_linear_f32
    function(rows.data_ptr(), rows.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
             out.data_ptr(), outputs, rows.shape[0], outputs, inputs, _threads())
    return out.view(*x.shape[:-1], outputs)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    rows = _rows(x)
    residual_rows = None if residual is None else _rows(residual)
    total = None if residual is None else torch.empty(rows.shape, dtype=x.dtype)
    out = torch.empty(rows.shape, dtype=x.dtype)
    _lib().llm_rms_norm(rows.data_ptr(), rows.stride(0),
                        None if residual_rows is None else residual_rows.data_ptr(),
                        0 if residual_rows is None else residual_rows.stride(0),
                        None if total is None else total.data_ptr(), 0 if total is None else total.stride(0),
                        weight.data_ptr(), out.data_ptr(), out.stride(0), rows.shape[0], rows.shape[1], eps,
                        DTYPES[x.dtype], _threads())
    return total, out


def _norm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_library is not None and _on_cpu(x, weight) and weight.dim() == 1 and weight.is_contiguous()
            and weight.shape[0] == x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's ``RMSNorm`` of the last dimension: ``weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)``."""
    if not _norm_takes(x, weight):
        y = x.to(torch.float32)
        return weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return _norm(x, None, weight, eps)[1].view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total, rms_norm(total))`` with ``total = residual + x`` rounded to the dtype (one pass)."""
    if x.shape != residual.shape or not _norm_takes(x, weight) or residual.dtype != x.dtype:
        total = residual + x
        return total, rms_norm(total, weight, eps)
    total, out = _norm(x, residual, weight, eps)
    return total.view(x.shape), out.view(x.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]``, the activation rounded to the dtype before the product."""
    if gate_up.shape[-1] % 2 or _library is None or not _on_cpu(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    rows = _rows(gate_up)
    intermediate = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], intermediate), dtype=gate_up.dtype)
    _lib().llm_silu_and_mul(rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], intermediate,
                            DTYPES[gate_up.dtype], _threads())
    return out.view(*gate_up.shape[:-1], intermediate)


def rotary_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``apply_rotary`` takes these: q [B, Hq, T, D] and k [B, Hk, T, D] with a contiguous last
    dimension, cos and sin [B or 1, T, D] of one layout, one dtype, on the CPU."""
    if _library is None or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    batch, _, tokens, dim = q.shape
    return (k.shape[0] == batch and k.shape[2] == tokens and k.shape[3] == dim and dim % 2 == 0
            and cos.shape[1:] == (tokens, dim) and cos.shape[0] in (1, batch) and _on_cpu(q, k, cos, sin)
            and q.stride(3) == 1 and k.stride(3) == 1 and cos.stride() == sin.stride() and cos.stride(2) == 1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Llama's ``apply_rotary_pos_emb(q, k, cos, sin)`` (``unsqueeze_dim=1``); outputs keep q's and k's layout."""
    if not rotary_supported(q, k, cos, sin):
        raise ValueError(f"apply_rotary cannot take q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, "
                         f"cos {tuple(cos.shape)} {cos.dtype}")
    cos_strides = (ctypes.c_int64 * 2)(cos.stride(0) if cos.shape[0] == q.shape[0] else 0, cos.stride(1))
    outputs = []
    for x in (q, k):
        out = torch.empty_like(x)
        batch, heads, tokens, dim = x.shape
        if x.numel():
            _lib().llm_rotary(x.data_ptr(), (ctypes.c_int64 * 3)(*x.stride()[:3]), out.data_ptr(),
                              (ctypes.c_int64 * 3)(*out.stride()[:3]), cos.data_ptr(), sin.data_ptr(), cos_strides,
                              batch, heads, tokens, dim, DTYPES[x.dtype], _threads())
        outputs.append(out)
    return outputs[0], outputs[1]


def use_amx(on: bool = True) -> bool:
    """Let bfloat16 products of 2-16 rows run on AMX tiles (the default) or not (a benchmark's comparison);
    returns whether they will: the library was built for a CPU with AMX and the kernel permits its tiles."""
    return bool(_lib().llm_use_amx(int(on)))


def greedy_pick(logits: torch.Tensor) -> torch.Tensor | None:
    """``llm_api.engine.sampler.greedy_pick`` in one pass for logits [B, V] (float32 or bfloat16, last dimension
    contiguous, on the CPU): [each row's argmax, whether all of the row is finite (1 or 0)] (int64 [2, B]);
    None where the library is not loaded or the logits are not such (the caller uses torch)."""
    if (_library is None or logits.dim() != 2 or logits.device.type != "cpu" or logits.dtype not in DTYPES
            or logits.stride(-1) != 1 or logits.shape[1] == 0):
        return None
    out = torch.empty((2, logits.shape[0]), dtype=torch.int64)
    _library.llm_greedy_pick(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr(),
                             DTYPES[logits.dtype], _threads())
    return out


# ------------------------------------------------------------------------------------------------------
# A Llama decoder layer in two calls around the attention (llm_api.engine.fused_layers' whole-layer path)

def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class LayerWeights:
    """What ``layer_in`` and ``layer_out`` read of one decoder layer, as raw pointers taken once (a decode step
    calls them 2 x layers times: ~20 Python attribute reads a layer less each step). The tensors are kept
    referenced, so the pointers stay valid while this object lives; the caller checks that the layer
    still holds these tensors (``llm_api.engine.fused_layers``)."""

    def __init__(self, input_norm: Any, post_norm: Any, next_norm: Any, qkv: Any, head_dim: int, o_proj: Any,
                 gate_up: Any, down_proj: Any, lora_slots: tuple = (None,) * 7):
        self.tensors = [t for t in (input_norm.weight, post_norm.weight, None if next_norm is None else next_norm.weight,
                                    qkv.weight, qkv.bias, o_proj.weight, o_proj.bias, gate_up.weight, gate_up.bias,
                                    down_proj.weight, down_proj.bias) if t is not None]
        self.dtype = qkv.weight.dtype
        self.input_norm, self.input_eps = input_norm.weight.data_ptr(), float(input_norm.variance_epsilon)
        self.post_norm, self.post_eps = post_norm.weight.data_ptr(), float(post_norm.variance_epsilon)
        self.next_norm = None if next_norm is None else next_norm.weight.data_ptr()
        self.next_eps = 0.0 if next_norm is None else float(next_norm.variance_epsilon)
        self.qkv, self.qkv_bias = qkv.weight.data_ptr(), _pointer(qkv.bias)
        self.n_q, self.n_kv, self.head_dim = qkv.sizes[0], qkv.sizes[1], head_dim
        self.o_proj, self.o_bias = o_proj.weight.data_ptr(), _pointer(o_proj.bias)
        self.gate_up, self.gate_up_bias = gate_up.weight.data_ptr(), _pointer(gate_up.bias)
        self.down, self.down_bias = down_proj.weight.data_ptr(), _pointer(down_proj.bias)
        self.hidden, self.intermediate = down_proj.weight.shape[0], gate_up.weight.shape[0] // 2
        # (q, k, v, o, gate, up, down: each product's LoRA adapters where it is wrapped, llm_api.lora.ops'
        # ModuleSlots, else None) and each product's (outputs, inputs)
        self.lora_slots = lora_slots
        self.lora_products: Any = None  # (the LoraProducts of these slots, kept by llm_api.engine.fused_layers)
        self.product_sizes = ((self.n_q, self.hidden), (self.n_kv, self.hidden), (self.n_kv, self.hidden),
                              (self.hidden, o_proj.weight.shape[1]), (self.intermediate, self.hidden),
                              (self.intermediate, self.hidden), (self.hidden, self.intermediate))


class _Lora(ctypes.Structure):
    """kernels.c's ``llm_lora_t``: keep the two in step."""

    _fields_ = [("a", ctypes.c_void_p), ("bt", ctypes.c_void_p), ("c", ctypes.c_int64)]


class _LoraRows(ctypes.Structure):
    """kernels.c's ``llm_lora_rows_t``: keep the two in step."""

    _fields_ = [("offset", ctypes.c_void_p), ("width", ctypes.c_void_p), ("scaling", ctypes.c_void_p)]


class LoraRows:
    """A step's rows as the LoRA deltas read them (``llm_api.lora``'s CPU layout, ``llm_api.lora.context``):
    each row's own columns of the concatenated adapters (``offsets``, ``widths``; width 0: the base model)
    and its adapter's ``scalings`` (in the model's dtype, as the torch path multiplies by them). ``columns``:
    how many columns the concatenated adapters have (every product's the same)."""

    def __init__(self, offsets: list[int], widths: list[int], scalings: torch.Tensor, columns: int):
        if any(o < 0 or w < 0 or o + w > columns for o, w in zip(offsets, widths)) or len(offsets) != len(widths):
            raise ValueError("LoraRows: a row's columns lie outside the adapters'")
        self.rows, self.columns = len(offsets), columns
        self.offsets = torch.tensor(offsets, dtype=torch.int64)
        self.widths = torch.tensor(widths, dtype=torch.int64)
        self.scalings = scalings.to(torch.float32).reshape(-1).contiguous()
        if self.scalings.numel() != self.rows:
            raise ValueError("LoraRows: one scaling a row")
        self.struct = _LoraRows(self.offsets.data_ptr(), self.widths.data_ptr(), self.scalings.data_ptr())


class LoraProducts:
    """The LoRA deltas of a run of products (one layer's seven: q, k, v, o, gate, up, down; or every layer's)
    as kernels.c's ``llm_lora_t`` array: per product its adapters concatenated, ``(a [C, in], bt [C, out])``
    (``llm_api.lora.ops.ModuleSlots.concatenated_t``: B transposed), or None where nothing adapts it. Checked
    against each product's ``(out, in)`` and the rows' ``C``, since the C side trusts them; the tensors stay
    referenced while this lives."""

    def __init__(self, pairs: list, sizes: list[tuple[int, int]], dtype: torch.dtype, columns: int):
        self.pairs, self.columns = pairs, columns
        self.array = (_Lora * len(pairs))()
        for entry, pair, (outputs, inputs) in zip(self.array, pairs, sizes):
            if pair is None:
                continue
            a, bt = pair
            if not (tuple(a.shape) == (columns, inputs) and tuple(bt.shape) == (columns, outputs)
                    and a.is_contiguous() and bt.is_contiguous() and _on_cpu(a, bt) and a.dtype == dtype):
                raise ValueError(f"LoraProducts: adapters of {tuple(a.shape)} and {tuple(bt.shape)} (transposed B) "
                                 f"for a product of {inputs} -> {outputs} over {columns} columns")
            entry.a, entry.bt, entry.c = a.data_ptr(), bt.data_ptr(), columns

    def at(self, index: int) -> Any:
        """A pointer to the entries from product ``index`` on."""
        return ctypes.byref(self.array, index * ctypes.sizeof(_Lora))


def _lora_args(lora: tuple[LoraRows, LoraProducts] | None, index: int) -> tuple[Any, Any]:
    return (None, None) if lora is None else (lora[1].at(index), ctypes.byref(lora[0].struct))


def layer_in(weights: LayerWeights, hidden: torch.Tensor, normed: torch.Tensor | None, cos: torch.Tensor,
             sin: torch.Tensor, lora: tuple[LoraRows, LoraProducts] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer before its attention, for rows ``hidden`` [T, D] (contiguous, ``weights.dtype``): the input
    norm (unless ``normed``, handed over by the layer before, is given), the merged q/k/v product (with
    ``lora``, the rows' adapters' deltas of q, k and v: the layer's ``LoraProducts``, entries 0-2) and the
    rotary embedding of q and k by ``cos``/``sin`` [T, head_dim] (last dimension contiguous). Returns
    ``(q [T, Nq], k [T, Nk], v [T, Nk])``, v a view of the product's output."""
    rows = hidden.shape[0]
    n_q, n_kv = weights.n_q, weights.n_kv
    qkv = torch.empty((rows, n_q + 2 * n_kv), dtype=hidden.dtype)
    q = torch.empty((rows, n_q), dtype=hidden.dtype)
    k = torch.empty((rows, n_kv), dtype=hidden.dtype)
    failed = _lib().llm_layer_in(hidden.data_ptr(), None if normed is None else normed.data_ptr(), weights.input_norm,
                                 weights.input_eps, weights.qkv, weights.qkv_bias, n_q, n_kv, weights.head_dim,
                                 cos.data_ptr(), sin.data_ptr(), cos.stride(0), qkv.data_ptr(), q.data_ptr(), k.data_ptr(),
                                 rows, weights.hidden, *_lora_args(lora, 0), DTYPES[hidden.dtype], _threads())
    if failed:
        raise MemoryError("layer_in: out of memory for its scratch")
    return q, k, qkv[:, n_q + n_kv:]


def layer_out(weights: LayerWeights, attention: torch.Tensor, hidden: torch.Tensor,
              lora: tuple[LoraRows, LoraProducts] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer after its attention, for rows ``attention`` [T, Nq] (last dimension contiguous) and the
    residual stream ``hidden`` [T, D] (contiguous): o_proj, the residual sum and post-attention norm, the
    merged gate/up product, SiLU x up, down (with ``lora``, the deltas of o, gate, up and down: entries 3-6),
    the residual sum, and where the layer has a next norm, that norm of it. Returns ``(hidden_out,
    normed_out or None)``."""
    hidden_out = torch.empty_like(hidden)
    normed_out = None if weights.next_norm is None else torch.empty_like(hidden)
    failed = _lib().llm_layer_out(attention.data_ptr(), attention.stride(0), hidden.data_ptr(), weights.o_proj, weights.o_bias,
                                  weights.post_norm, weights.post_eps, weights.gate_up, weights.gate_up_bias, weights.down,
                                  weights.down_bias, weights.next_norm, weights.next_eps, hidden_out.data_ptr(),
                                  None if normed_out is None else normed_out.data_ptr(), hidden.shape[0], weights.hidden,
                                  attention.shape[1], weights.intermediate, *_lora_args(lora, 3), DTYPES[hidden.dtype],
                                  _threads())
    if failed:
        raise MemoryError("layer_out: out of memory for its scratch")
    return hidden_out, normed_out


def paged_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scaling: float) -> torch.Tensor:
    """A step's attention over the paged cache, a query row at a time: every row's ``key``/``value`` [B, Nk]
    (rows of Hkv x D, last dimension contiguous) stored at the pool rows ``slots`` [B] (< 0: nowhere), then
    each row of ``query`` [B, Nq] attends ``context_lens`` [B] tokens through its ``block_tables`` row
    (int64, contiguous): a decode row its sequence's whole context; several rows of one sequence (drafts, a
    prompt chunk) each up to its own position, which makes the step causal because every store comes first.
    ``key_cache``/``value_cache`` [blocks, block_size, Hkv, D] contiguous, the query's dtype. Returns out
    [B, Nq] (softmax in float32, rounded once)."""
    rows = query.shape[0]
    _, block_size, kv_heads, head_dim = key_cache.shape
    out = torch.empty((rows, query.shape[1]), dtype=query.dtype)
    failed = _lib().llm_paged_decode(query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(),
                                     value.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(),
                                     block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
                                     out.data_ptr(), rows, query.shape[1] // head_dim, kv_heads, head_dim,
                                     block_size, scaling, DTYPES[query.dtype], _threads())
    if failed:
        raise MemoryError("paged_decode: out of memory for its scores")
    return out


# ------------------------------------------------------------------------------------------------------
# A step of a few rows through every layer in one call (llm_api.engine.fused_layers' whole-stack path)

class _Layer(ctypes.Structure):
    """kernels.c's ``llm_layer_t``: keep the two in step."""

    _fields_ = [*((name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "next_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias", "down",
        "down_bias", "key_cache", "value_cache")),
        *((name, ctypes.c_int64) for name in ("n_q", "n_kv", "head_dim", "inter")),
        *((name, ctypes.c_float) for name in ("input_eps", "post_eps", "next_eps", "scaling"))]


class DecodeStack:
    """Every decoder layer's ``LayerWeights`` and attention scaling as the array ``decode_layers`` hands to C,
    with the KV pool's pages of each layer filled in by ``decode_layers`` (they are checked again whenever
    the pool's tensors change). The layers' weights stay referenced through their ``LayerWeights``."""

    def __init__(self, layers: list[LayerWeights], scalings: list[float]):
        self.layers = layers
        self.dtype = layers[0].dtype
        self.hidden = layers[0].hidden
        self.array = (_Layer * len(layers))()
        for entry, weights, scaling in zip(self.array, layers, scalings):
            entry.input_norm, entry.post_norm, entry.next_norm = weights.input_norm, weights.post_norm, weights.next_norm
            entry.qkv, entry.qkv_bias, entry.o, entry.o_bias = weights.qkv, weights.qkv_bias, weights.o_proj, weights.o_bias
            entry.gate_up, entry.gate_up_bias = weights.gate_up, weights.gate_up_bias
            entry.down, entry.down_bias = weights.down, weights.down_bias
            entry.n_q, entry.n_kv, entry.head_dim, entry.inter = (weights.n_q, weights.n_kv, weights.head_dim,
                                                                  weights.intermediate)
            entry.input_eps, entry.post_eps, entry.next_eps = weights.input_eps, weights.post_eps, weights.next_eps
            entry.scaling = scaling
        self.pages: tuple = ()  # the (key, value) data pointers filled in
        self.lora_products: Any = None  # (every layer's LoraProducts, kept by llm_api.engine.fused_layers)
        self.block_size = 0

    def _take_pages(self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor]) -> bool:
        """Point each layer at its pages; False where the pool is not what the C side reads ([blocks,
        block_size, Hkv, head_dim], contiguous, the weights' dtype, on the CPU)."""
        pages = tuple(t.data_ptr() for t in key_caches) + tuple(t.data_ptr() for t in value_caches)
        if pages == self.pages:
            return True
        if len(key_caches) != len(self.layers) or len(value_caches) != len(self.layers):
            return False
        block_size = key_caches[0].shape[1]
        for weights, key, value in zip(self.layers, key_caches, value_caches):
            shape = (block_size, weights.n_kv // weights.head_dim, weights.head_dim)
            if not all(t.dim() == 4 and tuple(t.shape[1:]) == shape and t.dtype == self.dtype and t.is_contiguous()
                       and t.device.type == "cpu" for t in (key, value)) or key.shape[0] != value.shape[0]:
                return False
        for entry, key, value in zip(self.array, key_caches, value_caches):
            entry.key_cache, entry.value_cache = key.data_ptr(), value.data_ptr()
        self.pages, self.block_size = pages, block_size
        return True


def decode_layers(stack: DecodeStack, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], slots: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                  lora: tuple[LoraRows, LoraProducts] | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A step's rows ``hidden`` [T, D] (contiguous, the stack's dtype) through every layer: per layer
    ``layer_in``, ``paged_decode`` (every row's K/V stored at ``slots``, then each row's attention through its
    ``block_tables`` row over its ``context_lens`` tokens, a row each, int64, contiguous) and ``layer_out``,
    with the same numbers; with ``lora``, every layer's adapters' deltas (``LoraProducts`` of 7 products a
    layer). ``cos``/``sin`` [B, head_dim] (last dimension contiguous). Returns ``(hidden_out,
    normed_out)``, the last layer's output and its next norm's (None where it has none), or None where the
    KV pool is not one the C side reads (the caller runs the layers one by one)."""
    if not stack._take_pages(key_caches, value_caches):
        return None
    rows = hidden.shape[0]
    hidden_out = torch.empty_like(hidden)
    normed_out = None if stack.layers[-1].next_norm is None else torch.empty_like(hidden)
    failed = _lib().llm_decode_layers(stack.array, len(stack.layers), hidden.data_ptr(), hidden_out.data_ptr(),
                                      None if normed_out is None else normed_out.data_ptr(), cos.data_ptr(),
                                      sin.data_ptr(), cos.stride(0), slots.data_ptr(), block_tables.data_ptr(),
                                      block_tables.stride(0), context_lens.data_ptr(), rows, stack.hidden,
                                      stack.block_size, *_lora_args(lora, 0), DTYPES[stack.dtype], _threads())
    if failed:
        raise MemoryError("decode_layers: out of memory for its scratch")
    return hidden_out, normed_out
