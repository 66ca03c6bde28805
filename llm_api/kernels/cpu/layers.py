"""A Llama decoder layer of a few rows as C calls (``kernels.c``): two calls around its attention (``layer_in``,
``layer_out``), a step's paged attention in one (``paged_decode``), and a step's every layer in one
(``decode_layers``); LoRA adapters' deltas inside those calls, each row over its own adapter's columns
(``LoraRows``, ``LoraProducts``). ``llm_api.models.whole_layers`` plans and calls them; ``llm_api.kernels.cpu``
re-exports them as part of its kernel set.

A layer's products are ``quant.Product``s: a plain float weight (q/k/v or gate/up merged into one) or up to
three parts in GGUF block formats, so the same calls run a float checkpoint and a quantized one.

The C side reads memory through the offsets these hand it, and checks nothing it would have to read a table
for. So what it assumes is checked here: at plan time every shape the layer's C code relies on
(``LayerWeights``: heads divide, products chain, biases and norms have their lengths, one dtype); at each call
the tensors' shapes, dtypes and layouts (attribute reads, no pass over data); and once a step, the indices a
step hands over (``check_step_tables``: slots inside the pool, block ids below its block count, context
lengths within a row's table), by the caller that builds them (``llm_api.models.whole_layers.row_tables``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

import llm_api.kernels.cpu.library as library
from llm_api.kernels.cpu.library import DTYPES
from llm_api.kernels.cpu.quant import Product, _Product

# The most rows of one call (kernels.c's scratch and the products' tiles are sized for a decode step's few rows).
MAX_ROWS = 16


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _on_cpu(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return first.dtype in DTYPES and all(t.device.type == "cpu" and t.dtype == first.dtype for t in tensors)


def _failed(code: int, what: str) -> None:
    if code == 1:
        raise MemoryError(f"{what}: out of memory for its scratch")
    if code:
        raise ValueError(f"{what}: the CPU kernels refused the layer's products (code {code})")


class LayerWeights:
    """What ``layer_in`` and ``layer_out`` read of one decoder layer, taken once (a decode step calls them 2 x
    layers times): the norms' weights and epsilons, the four products (``quant.Product``: q/k/v with
    ``qkv_sizes`` (n_q, n_kv, n_kv), o, gate/up, down) and their biases, each product's LoRA slots, and (Qwen3)
    the per-head norms of q and k (``q_norm``, ``k_norm``: modules with ``weight`` [head_dim]). Every
    shape the C code assumes is checked here (ValueError); the tensors stay referenced while this lives, and the
    caller checks that the layer still holds them (``llm_api.models.whole_layers``)."""

    def __init__(self, input_norm: Any, post_norm: Any, next_norm: Any, qkv: Product, qkv_sizes: tuple[int, int, int],
                 qkv_bias: torch.Tensor | None, head_dim: int, o: Product, o_bias: torch.Tensor | None, gate_up: Product,
                 gate_up_bias: torch.Tensor | None, down: Product, down_bias: torch.Tensor | None,
                 lora_slots: tuple = (None,) * 7, q_norm: Any = None, k_norm: Any = None):
        norms = [input_norm.weight, post_norm.weight, *(() if next_norm is None else (next_norm.weight,))]
        head_norms = [n.weight for n in (q_norm, k_norm) if n is not None]
        self.dtype = input_norm.weight.dtype
        self.hidden = int(input_norm.weight.shape[0])
        self.n_q, self.n_kv = int(qkv_sizes[0]), int(qkv_sizes[1])
        self.head_dim = int(head_dim)
        self.intermediate = gate_up.out_features // 2
        self.products = (qkv, o, gate_up, down)
        biases = (qkv_bias, o_bias, gate_up_bias, down_bias)
        self._check(norms, qkv_sizes, biases)
        if not all(n.dim() == 1 and n.shape[0] == self.head_dim and n.is_contiguous() and _on_cpu(n, norms[0])
                   for n in head_norms):
            raise ValueError(f"a decoder layer the CPU kernels cannot run: q/k norms that are not [{self.head_dim}] "
                             f"of {self.dtype}")
        self.tensors = [*norms, *head_norms, *(b for b in biases if b is not None)]
        self.q_norm = None if q_norm is None else q_norm.weight.data_ptr()
        self.k_norm = None if k_norm is None else k_norm.weight.data_ptr()
        self.q_eps = 0.0 if q_norm is None else float(q_norm.variance_epsilon)
        self.k_eps = 0.0 if k_norm is None else float(k_norm.variance_epsilon)
        self.input_norm, self.input_eps = input_norm.weight.data_ptr(), float(input_norm.variance_epsilon)
        self.post_norm, self.post_eps = post_norm.weight.data_ptr(), float(post_norm.variance_epsilon)
        self.next_norm = None if next_norm is None else next_norm.weight.data_ptr()
        self.next_eps = 0.0 if next_norm is None else float(next_norm.variance_epsilon)
        self.qkv, self.o_proj, self.gate_up, self.down = (p.pointer() for p in self.products)
        self.qkv_bias, self.o_bias, self.gate_up_bias, self.down_bias = (_pointer(b) for b in biases)
        # (q, k, v, o, gate, up, down: each product's LoRA adapters where it is wrapped, llm_api.lora.ops'
        # ModuleSlots, else None) and each product's (outputs, inputs)
        self.lora_slots = lora_slots
        self.lora_products: Any = None  # (the LoraProducts of these slots, kept by llm_api.models.whole_layers)
        self.product_sizes = ((self.n_q, self.hidden), (self.n_kv, self.hidden), (self.n_kv, self.hidden),
                              (self.hidden, self.n_q), (self.intermediate, self.hidden),
                              (self.intermediate, self.hidden), (self.hidden, self.intermediate))

    def _check(self, norms: list[torch.Tensor], qkv_sizes: tuple[int, int, int], biases: tuple) -> None:
        qkv, o, gate_up, down = self.products
        hidden, n_q, n_kv, head_dim, inter = self.hidden, self.n_q, self.n_kv, self.head_dim, self.intermediate
        problems = []
        if self.dtype not in DTYPES:
            problems.append(f"activations of {self.dtype}")
        if not all(n.dim() == 1 and n.shape[0] == hidden and n.is_contiguous() and _on_cpu(n, norms[0]) for n in norms):
            problems.append("norm weights of different lengths, dtypes or layouts")
        if (head_dim <= 0 or head_dim % 2 or n_q % head_dim or n_kv % head_dim or n_kv <= 0
                or (n_q // head_dim) % (n_kv // head_dim) or qkv_sizes[1] != qkv_sizes[2]):
            problems.append(f"q/k/v of {qkv_sizes} values for heads of {head_dim}")
        expected = ((qkv, hidden, n_q + 2 * n_kv), (o, n_q, hidden), (gate_up, hidden, 2 * inter), (down, inter, hidden))
        for name, (product, inputs, outputs) in zip(("q/k/v", "o", "gate/up", "down"), expected):
            if product.in_features != inputs or product.out_features != outputs or product.dense_dtype not in (None, self.dtype):
                problems.append(f"{name}: {product.in_features} -> {product.out_features}, expected {inputs} -> {outputs}")
        if gate_up.out_features % 2:
            problems.append("gate/up of an odd width")
        for name, bias, (_, _, outputs) in zip(("q/k/v", "o", "gate/up", "down"), biases, expected):
            if bias is not None and not (bias.dim() == 1 and bias.shape[0] == outputs and bias.is_contiguous()
                                         and _on_cpu(bias, norms[0])):
                problems.append(f"{name} bias of {tuple(bias.shape)}, expected ({outputs},)")
        if problems:
            raise ValueError("a decoder layer the CPU kernels cannot run: " + "; ".join(problems))


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


def _lora_args(lora: tuple[LoraRows, LoraProducts] | None, index: int, rows: int) -> tuple[Any, Any]:
    if lora is None:
        return None, None
    if lora[0].rows != rows:
        raise ValueError(f"the LoRA rows are {lora[0].rows}, the call's {rows}")
    return lora[1].at(index), ctypes.byref(lora[0].struct)


def _check_rows(what: str, dtype: torch.dtype, hidden: torch.Tensor, width: int) -> int:
    rows = hidden.shape[0] if hidden.dim() == 2 else -1
    if not (0 < rows <= MAX_ROWS and hidden.shape[1] == width and hidden.is_contiguous() and hidden.dtype == dtype
            and hidden.device.type == "cpu"):
        raise ValueError(f"{what}: rows of {tuple(hidden.shape)} {hidden.dtype}, expected 1-{MAX_ROWS} contiguous "
                         f"rows of {width} {dtype}")
    return rows


def _check_rotary(what: str, dtype: torch.dtype, cos: torch.Tensor, sin: torch.Tensor, rows: int, head_dim: int) -> None:
    if not (cos.dim() == 2 and cos.shape == (rows, head_dim) and cos.shape == sin.shape and cos.stride() == sin.stride()
            and cos.stride(-1) == 1 and _on_cpu(cos, sin) and cos.dtype == dtype):
        raise ValueError(f"{what}: cos/sin of {tuple(cos.shape)}, expected ({rows}, {head_dim}) {dtype}")


def layer_in(weights: LayerWeights, hidden: torch.Tensor, normed: torch.Tensor | None, cos: torch.Tensor,
             sin: torch.Tensor, lora: tuple[LoraRows, LoraProducts] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer before its attention, for rows ``hidden`` [T, D] (contiguous, ``weights.dtype``): the input
    norm (unless ``normed``, handed over by the layer before, is given), the q/k/v product (with ``lora``, the
    rows' adapters' deltas of q, k and v: the layer's ``LoraProducts``, entries 0-2) and the rotary embedding of
    q and k by ``cos``/``sin`` [T, head_dim] (last dimension contiguous). Returns ``(q [T, Nq], k [T, Nk],
    v [T, Nk])``, v a view of the product's output."""
    rows = _check_rows("layer_in", weights.dtype, hidden, weights.hidden)
    if normed is not None:
        _check_rows("layer_in (normed)", weights.dtype, normed, weights.hidden)
    _check_rotary("layer_in", weights.dtype, cos, sin, rows, weights.head_dim)
    n_q, n_kv = weights.n_q, weights.n_kv
    qkv = torch.empty((rows, n_q + 2 * n_kv), dtype=hidden.dtype)
    q = torch.empty((rows, n_q), dtype=hidden.dtype)
    k = torch.empty((rows, n_kv), dtype=hidden.dtype)
    failed = library.lib().llm_layer_in(
        hidden.data_ptr(), None if normed is None else normed.data_ptr(), weights.input_norm, weights.input_eps,
        weights.qkv, weights.qkv_bias, n_q, n_kv, weights.head_dim, weights.q_norm, weights.k_norm, weights.q_eps,
        weights.k_eps, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
        qkv.data_ptr(), q.data_ptr(), k.data_ptr(), rows, weights.hidden, *_lora_args(lora, 0, rows),
        DTYPES[hidden.dtype], library.threads())
    _failed(failed, "layer_in")
    return q, k, qkv[:, n_q + n_kv:]


def layer_out(weights: LayerWeights, attention: torch.Tensor, hidden: torch.Tensor,
              lora: tuple[LoraRows, LoraProducts] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer after its attention, for rows ``attention`` [T, Nq] (last dimension contiguous) and the
    residual stream ``hidden`` [T, D] (contiguous): o_proj, the residual sum and post-attention norm, the
    gate/up product, SiLU x up, down (with ``lora``, the deltas of o, gate, up and down: entries 3-6), the
    residual sum, and where the layer has a next norm, that norm of it. Returns ``(hidden_out, normed_out or
    None)``."""
    rows = _check_rows("layer_out", weights.dtype, hidden, weights.hidden)
    if not (attention.dim() == 2 and attention.shape == (rows, weights.n_q) and attention.stride(-1) == 1
            and attention.dtype == weights.dtype and attention.device.type == "cpu"):
        raise ValueError(f"layer_out: attention of {tuple(attention.shape)}, expected ({rows}, {weights.n_q})")
    hidden_out = torch.empty_like(hidden)
    normed_out = None if weights.next_norm is None else torch.empty_like(hidden)
    failed = library.lib().llm_layer_out(
        attention.data_ptr(), attention.stride(0), hidden.data_ptr(), weights.o_proj, weights.o_bias,
        weights.post_norm, weights.post_eps, weights.gate_up, weights.gate_up_bias, weights.down, weights.down_bias,
        weights.next_norm, weights.next_eps, hidden_out.data_ptr(), None if normed_out is None else normed_out.data_ptr(),
        rows, weights.hidden, attention.shape[1], weights.intermediate, *_lora_args(lora, 3, rows),
        DTYPES[hidden.dtype], library.threads())
    _failed(failed, "layer_out")
    return hidden_out, normed_out


def check_step_tables(slots: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, blocks: int,
                      block_size: int) -> None:
    """The indices a step hands to the C attention, checked once a step (ValueError naming the first that is
    wrong): ``slots`` [B] pool rows (< 0: stored nowhere) below ``blocks x block_size``; ``block_tables``
    [B, width] block ids below ``blocks``; ``context_lens`` [B] from 0 to ``width x block_size``; all int64,
    contiguous, on the CPU."""
    rows = slots.shape[0] if slots.dim() == 1 else -1
    for name, tensor, dims in (("slots", slots, 1), ("block tables", block_tables, 2), ("context lengths", context_lens, 1)):
        if tensor.dim() != dims or tensor.dtype != torch.int64 or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"{name}: {tensor.dtype} {tuple(tensor.shape)}, expected contiguous CPU int64 of {dims} dims")
        if tensor.shape[0] != rows:
            raise ValueError(f"{name}: {tensor.shape[0]} rows, the step has {rows}")
    if rows == 0:
        return
    width = block_tables.shape[1]
    for name, tensor, low, high in (("slot", slots, -1, blocks * block_size - 1), ("block id", block_tables, 0, blocks - 1),
                                    ("context length", context_lens, 0, width * block_size)):
        if tensor.numel():
            least, most = (int(v) for v in torch.aminmax(tensor))
            if least < low or most > high:
                raise ValueError(f"a {name} outside [{low}, {high}]: [{least}, {most}]")


def _check_attention(rows: int, query_width: int, dtype: torch.dtype, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, kv_width: int) -> None:
    """What the C attention reads, checked without a pass over data (the tables' values: ``check_step_tables``)."""
    if not (key_cache.dim() == 4 and key_cache.shape == value_cache.shape and key_cache.is_contiguous()
            and value_cache.is_contiguous() and key_cache.dtype == dtype and _on_cpu(key_cache, value_cache)
            and key_cache.shape[2] * key_cache.shape[3] == kv_width and query_width % key_cache.shape[3] == 0
            and (query_width // key_cache.shape[3]) % key_cache.shape[2] == 0):
        raise ValueError(f"paged attention: a pool of {tuple(key_cache.shape)} {key_cache.dtype} for queries of "
                         f"{query_width} {dtype}")
    if not (slots.shape == (rows,) and context_lens.shape == (rows,) and block_tables.dim() == 2
            and block_tables.shape[0] == rows and block_tables.stride(-1) == 1
            and all(t.dtype == torch.int64 and t.device.type == "cpu" for t in (slots, block_tables, context_lens))
            and slots.is_contiguous() and context_lens.is_contiguous()):
        raise ValueError(f"paged attention: tables of {tuple(slots.shape)}, {tuple(block_tables.shape)}, "
                         f"{tuple(context_lens.shape)} for {rows} rows")


def _window(window: int | None) -> int:
    """A sliding window as the C side takes it (0: none)."""
    if window is not None and (int(window) != window or window < 1):
        raise ValueError(f"a sliding window of {window!r} tokens")
    return 0 if window is None else int(window)


def paged_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scaling: float, window: int | None = None) -> torch.Tensor:
    """A step's attention over the paged cache, a query row at a time: every row's ``key``/``value`` [B, Nk]
    (rows of Hkv x D, last dimension contiguous) stored at the pool rows ``slots`` [B] (< 0: nowhere), then
    each row of ``query`` [B, Nq] attends ``context_lens`` [B] tokens through its ``block_tables`` row
    (int64, contiguous): a decode row its sequence's whole context; several rows of one sequence (drafts, a
    prompt chunk) each up to its own position, which makes the step causal because every store comes first.
    ``key_cache``/``value_cache`` [blocks, block_size, Hkv, D] contiguous, the query's dtype. Returns out
    [B, Nq] (softmax in float32, rounded once). With a sliding ``window``, a row attends only the last ``window``
    of its tokens. The tables' values are the caller's to check once a step (``check_step_tables``)."""
    rows = query.shape[0]
    _check_attention(rows, query.shape[1], query.dtype, key_cache, value_cache, slots, block_tables, context_lens,
                     key.shape[1])
    if not (key.shape == value.shape == (rows, key.shape[1]) and key.stride(-1) == 1 and value.stride(-1) == 1
            and _on_cpu(query, key, value) and query.stride(-1) == 1):
        raise ValueError(f"paged attention: keys of {tuple(key.shape)}, values of {tuple(value.shape)} for {rows} rows")
    _, block_size, kv_heads, head_dim = key_cache.shape
    out = torch.empty((rows, query.shape[1]), dtype=query.dtype)
    failed = library.lib().llm_paged_decode(
        query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
        key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        context_lens.data_ptr(), out.data_ptr(), rows, query.shape[1] // head_dim, kv_heads, head_dim, block_size,
        scaling, _window(window), DTYPES[query.dtype], library.threads())
    _failed(failed, "paged_decode")
    return out


# ------------------------------------------------------------------------------------------------------
# A step of a few rows through every layer in one call (llm_api.models.whole_layers' one-call step)

class _Layer(ctypes.Structure):
    """kernels.c's ``llm_layer_t``: keep the two in step."""

    _fields_ = [*((name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "next_norm", "qkv_bias", "o_bias", "gate_up_bias", "down_bias")),
        *((name, _Product) for name in ("qkv", "o", "gate_up", "down")),
        *((name, ctypes.c_void_p) for name in ("key_cache", "value_cache")),
        *((name, ctypes.c_int64) for name in ("n_q", "n_kv", "head_dim", "inter")),
        *((name, ctypes.c_float) for name in ("input_eps", "post_eps", "next_eps", "scaling")),
        *((name, ctypes.c_void_p) for name in ("q_norm", "k_norm")),
        *((name, ctypes.c_float) for name in ("q_eps", "k_eps")), ("window", ctypes.c_int64)]


class DecodeStack:
    """Every decoder layer's ``LayerWeights`` and attention scaling as the array ``decode_layers`` hands to C,
    with the KV pool's pages of each layer filled in by ``decode_layers`` (they are checked again whenever
    the pool's tensors change). The layers' weights stay referenced through their ``LayerWeights``."""

    def __init__(self, layers: list[LayerWeights], scalings: list[float], windows: list[int | None] | None = None):
        if any(w.dtype != layers[0].dtype or w.hidden != layers[0].hidden for w in layers):
            raise ValueError("DecodeStack: layers of different widths or dtypes")
        self.layers = layers
        self.dtype = layers[0].dtype
        self.hidden = layers[0].hidden
        self.array = (_Layer * len(layers))()
        for entry, weights, scaling, window in zip(self.array, layers, scalings, windows or [None] * len(layers)):
            entry.input_norm, entry.post_norm, entry.next_norm = weights.input_norm, weights.post_norm, weights.next_norm
            entry.qkv_bias, entry.o_bias = weights.qkv_bias, weights.o_bias
            entry.gate_up_bias, entry.down_bias = weights.gate_up_bias, weights.down_bias
            qkv, o, gate_up, down = (product.struct for product in weights.products)
            entry.qkv, entry.o, entry.gate_up, entry.down = qkv, o, gate_up, down  # (copies of the structs)
            entry.n_q, entry.n_kv, entry.head_dim, entry.inter = (weights.n_q, weights.n_kv, weights.head_dim,
                                                                  weights.intermediate)
            entry.input_eps, entry.post_eps, entry.next_eps = weights.input_eps, weights.post_eps, weights.next_eps
            entry.scaling = scaling
            entry.window = _window(window)
            entry.q_norm, entry.k_norm, entry.q_eps, entry.k_eps = (weights.q_norm, weights.k_norm, weights.q_eps,
                                                                    weights.k_eps)
        self.pages: tuple = ()  # the (key, value) data pointers filled in
        self.lora_products: Any = None  # (every layer's LoraProducts, kept by llm_api.models.whole_layers)
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
    KV pool is not one the C side reads (the caller runs the layers one by one). The tables' values are the
    caller's to check once a step (``check_step_tables``)."""
    if not stack._take_pages(key_caches, value_caches):
        return None
    rows = _check_rows("decode_layers", stack.dtype, hidden, stack.hidden)
    _check_rotary("decode_layers", stack.dtype, cos, sin, rows, stack.layers[0].head_dim)
    first = stack.layers[0]
    _check_attention(rows, first.n_q, stack.dtype, key_caches[0], value_caches[0], slots, block_tables, context_lens,
                     first.n_kv)
    hidden_out = torch.empty_like(hidden)
    normed_out = None if stack.layers[-1].next_norm is None else torch.empty_like(hidden)
    failed = library.lib().llm_decode_layers(
        stack.array, len(stack.layers), hidden.data_ptr(), hidden_out.data_ptr(),
        None if normed_out is None else normed_out.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
        slots.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), rows, stack.hidden,
        stack.block_size, *_lora_args(lora, 0, rows), DTYPES[stack.dtype], library.threads())
    _failed(failed, "decode_layers")
    return hidden_out, normed_out
