"""A model served from a GGUF file as it is: its configuration, tokenizer and chat template from the file's
metadata, its quantized tensors kept in their block formats (``llm_api.layers.quantized``).

The loader (``llm_api.model.loader``) reads the file (``llm_api.model.gguf_file``: header, metadata and tensor
table, checked), maps its architecture to the family that has the same decoder (``FAMILIES``: Llama, which covers
SmolLM, Mistral and Llama 2/3 files; Qwen2 and Qwen3), reads its configuration (``gguf_config``: our
``DecoderConfig``), builds the family's module tree with no weights (on the meta device: our
``llm_api.model.decoder_weights``, which the paged engine runs as our decoder, without importing transformers'
model classes; for ENGINE=generate transformers' classes of the family, whose ``generate()`` is the reference), and
puts every tensor of the file in its place, the same in either tree:

* a quantized linear weight (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) becomes a ``QuantizedLinear`` over
  the file's blocks, repacked once into groups of 8 rows where the format has that layout (the products read
  it several times faster: ``llm_api.kernels.cpu.quant``); the embedding table a ``QuantizedEmbedding``, and an
  output head tied to it (no ``output.weight`` in the file) a ``QuantizedLinear`` over the same blocks;
* F32, F16 and BF16 tensors (norms, biases, a float linear) become float tensors of the compute dtype;
* llama.cpp's converter interleaves each head's q and k rows for its rotary embedding (Llama-family files);
  those rows are put back in transformers' order (rows of blocks: a row permutation is exact on quantized
  rows). ``rope_freqs`` (Llama 3.1/3.2 files' scaling of the rotary frequencies) divides the rotary's.

Every tensor of the file must have a place and every weight of the model a tensor of the expected shape, or
the load stops with a ``GGUFError`` naming the file and the tensor: a truncated or corrupt file, an
architecture or quant type we do not serve, a shape that disagrees with the metadata. Nothing is served
half-loaded. The file's pages are copied into the process once and the file is closed after loading, so the
server's memory is the weights once (``bench/server_memory.py``).

The tokenizer is built from the file's vocabulary as llama.cpp reads it (``llm_api.model.gguf_tokenizer``: ~0.2 s
at each start, no transformers import): SentencePiece vocabularies and the byte-level ones whose pre-tokenizer it
has a rule for (GPT-2, StarCoder/SmolLM, Llama 3, Qwen2, DeepSeek Coder). For any other, transformers' conversion
(``AutoTokenizer.from_pretrained(..., gguf_file=...)``: ~7 s for a 49k vocabulary on a 2-core host), saved once per
file under the cache folder (``gguf-tokenizers/<digest of the file's metadata>``) and read from there by
``llm_api.model.tokenizer`` (~0.1 s) once it reads back as the same tokenizer (checked once, on the first start).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from llm_api.kernels.cpu import library as cpu_library
from llm_api.kernels.cpu import quant
from llm_api.layers.quantized import QuantizedEmbedding, QuantizedLinear
from llm_api.model.gguf_file import GGUFError, GGUFFile, TensorInfo, type_name
from llm_api.model.gguf_tokenizer import build_tokenizer
from llm_api.model.settings import ConfigError
from llm_api.model.decoder_config import DecoderConfig
from llm_api.model.decoder_weights import CausalLMWeights
from llm_api.model.tokenizer import converted_tokenizer

logger = logging.getLogger(__name__)

FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}


@dataclass(frozen=True)
class Family:
    """How a GGUF architecture maps onto a transformers model type."""

    model_type: str
    interleaved_qk: bool  # the converter interleaved q/k rows for llama.cpp's rotary (undone at load)


FAMILIES = {"llama": Family("llama", True), "qwen2": Family("qwen2", False), "qwen3": Family("qwen3", False)}

# Per decoder layer: the GGUF tensor's name after "blk.N." -> the module path in the transformers layer.
LAYER_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
LAYER_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def _metadata(file: GGUFFile, key: str, kind: type, default: Any = None) -> Any:
    value = file.metadata.get(key, default)
    if value is None:
        raise GGUFError(f"{file.path}: the metadata has no {key!r}")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise GGUFError(f"{file.path}: metadata {key!r} is {type(value).__name__}, expected {kind.__name__}")
    if kind is float and not 0 < cast(float, value) < float("inf"):  # (a rotary base, a factor, an epsilon; NaN too)
        raise GGUFError(f"{file.path}: metadata {key!r} = {value} is not a positive finite number")
    if kind is int and not 0 < cast(int, value) < 2**31:
        raise GGUFError(f"{file.path}: metadata {key!r} = {value} is out of range")
    return value


def gguf_config(file: GGUFFile) -> DecoderConfig:
    """The configuration of the file's model (its family's), from the metadata; GGUFError for an architecture or
    rotary scaling we do not serve."""
    arch = file.metadata.get("general.architecture")
    family = FAMILIES.get(arch) if isinstance(arch, str) else None
    if family is None:
        raise GGUFError(f"{file.path}: architecture {str(arch)[:60]!r} is not served (served: {', '.join(FAMILIES)})")
    p = f"{arch}."
    heads = _metadata(file, p + "attention.head_count", int)
    hidden = _metadata(file, p + "embedding_length", int)
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    vocab = file.metadata.get(p + "vocab_size", len(tokens) if isinstance(tokens, list) else None)
    if not isinstance(vocab, int) or vocab <= 0:
        raise GGUFError(f"{file.path}: no vocabulary size (neither {p}vocab_size nor tokenizer.ggml.tokens)")
    rope = {"rope_type": "default", "rope_theta": _metadata(file, p + "rope.freq_base", float, 10000.0)}
    scaling = file.metadata.get(p + "rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=_metadata(file, p + "rope.scaling.factor", float))
    elif scaling not in ("none", None):
        raise GGUFError(f"{file.path}: rotary scaling {str(scaling)[:40]!r} is not served (none or linear)")
    tokens_ids = {name: file.metadata[key] for name, key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id")) if isinstance(file.metadata.get(key), int)}
    try:  # (DecoderConfig refuses heads that cannot share key/value heads and heads of an odd width)
        return DecoderConfig(
            model_type=family.model_type, vocab_size=vocab, hidden_size=hidden,
            intermediate_size=_metadata(file, p + "feed_forward_length", int),
            num_hidden_layers=_metadata(file, p + "block_count", int), num_attention_heads=heads,
            num_key_value_heads=_metadata(file, p + "attention.head_count_kv", int, heads),
            head_dim=_metadata(file, p + "attention.key_length", int, hidden // heads),
            max_position_embeddings=_metadata(file, p + "context_length", int, 4096),
            rms_norm_eps=_metadata(file, p + "attention.layer_norm_rms_epsilon", float),
            rope_parameters=rope, tie_word_embeddings="output.weight" not in file.tensors, **tokens_ids)
    except ValueError as error:
        raise GGUFError(f"{file.path}: {error}") from None


def _tensor(file: GGUFFile, info: TensorInfo) -> torch.Tensor:
    """The tensor's bytes as a uint8 CPU tensor viewing the mapped file (no copy: read only)."""
    import warnings

    with warnings.catch_warnings():  # (torch warns that the array is not writable: nothing writes it)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(file.tensor_bytes(info.name))


def _float(file: GGUFFile, info: TensorInfo, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if info.type_id not in FLOAT_TYPES:
        raise GGUFError(f"{file.path}: tensor {info.name!r} is {type_name(info.type_id)}, expected a float type "
                        f"(F32, F16, BF16)")
    _expect_shape(file, info, shape)
    return _tensor(file, info).view(FLOAT_TYPES[info.type_id]).reshape(shape).to(dtype, copy=True)


def _expect_shape(file: GGUFFile, info: TensorInfo, shape: tuple[int, ...]) -> None:
    if tuple(info.shape) != tuple(shape):
        raise GGUFError(f"{file.path}: tensor {info.name!r} has shape {tuple(info.shape)}, the metadata says {tuple(shape)}")


def _quantized(file: GGUFFile, info: TensorInfo, shape: tuple[int, int], rows: torch.Tensor | None = None,
               repack: bool = True) -> quant.QuantizedWeight:
    """The weight's blocks, copied out of the file (``rows``: in this order), in groups of 8 rows where the format
    has that layout."""
    _expect_shape(file, info, shape)
    fmt = quant.BY_TYPE.get(info.type_id)
    if fmt is None:
        served = ", ".join(sorted(quant.FORMATS))
        raise GGUFError(f"{file.path}: tensor {info.name!r} is {type_name(info.type_id)}, a quant type not served "
                        f"(served: {served}, F32, F16, BF16)")
    blocks = _tensor(file, info).view(shape[0], fmt.row_bytes(shape[1]))
    weight = quant.QuantizedWeight(fmt, blocks if rows is None else blocks[rows], shape[1])
    if repack and fmt.name in quant.REPACKABLE:
        return quant.repack(weight)  # (a copy in the grouped layout)
    return quant.QuantizedWeight(fmt, weight.blocks.clone() if rows is None else weight.blocks, shape[1])


def _interleaved_rows(heads: int, head_dim: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k interleaving: transformers' row h*D + s*D/2 + j is the file's
    row h*D + 2j + s."""
    half = head_dim // 2
    index = (torch.arange(heads)[:, None, None] * head_dim + torch.arange(2)[None, :, None]
             + 2 * torch.arange(half)[None, None, :])
    return index.reshape(-1)


def _linear(file: GGUFFile, info: TensorInfo, shape: tuple[int, int], dtype: torch.dtype,
            rows: torch.Tensor | None, bias: torch.Tensor | None) -> nn.Module:
    if info.type_id in FLOAT_TYPES:
        weight = _float(file, info, shape, dtype)
        linear = nn.Linear(shape[1], shape[0], bias=bias is not None, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(weight if rows is None else weight[rows])
            if bias is not None:
                linear.bias.copy_(bias)
        return linear.requires_grad_(False)
    return QuantizedLinear(_quantized(file, info, shape, rows), bias)


def expected_tensors(file: GGUFFile, config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of ``config`` reads from the file, with its shape (torch order): the required ones,
    and the optional ones (biases, ``output.weight``, ``rope_freqs.weight``) where the file has them."""
    c = config
    head_dim = c.head_dim
    q_rows, kv_rows = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    shapes = {"attn_q": (q_rows, c.hidden_size), "attn_k": (kv_rows, c.hidden_size), "attn_v": (kv_rows, c.hidden_size),
              "attn_output": (c.hidden_size, q_rows), "ffn_gate": (c.intermediate_size, c.hidden_size),
              "ffn_up": (c.intermediate_size, c.hidden_size), "ffn_down": (c.hidden_size, c.intermediate_size)}
    expected: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.vocab_size, c.hidden_size),
                                            "output_norm.weight": (c.hidden_size,)}
    for i in range(c.num_hidden_layers):
        for short, shape in shapes.items():
            expected[f"blk.{i}.{short}.weight"] = shape
            if f"blk.{i}.{short}.bias" in file.tensors:
                expected[f"blk.{i}.{short}.bias"] = shape[:1]
        expected[f"blk.{i}.attn_norm.weight"] = expected[f"blk.{i}.ffn_norm.weight"] = (c.hidden_size,)
        if c.model_type == "qwen3":
            expected[f"blk.{i}.attn_q_norm.weight"] = expected[f"blk.{i}.attn_k_norm.weight"] = (head_dim,)
    if "output.weight" in file.tensors:
        expected["output.weight"] = (c.vocab_size, c.hidden_size)
    if "rope_freqs.weight" in file.tensors:
        expected["rope_freqs.weight"] = (head_dim // 2,)
    return expected


def check_tensors(file: GGUFFile, config: Any) -> None:
    """The file's tensor table against the model's (names, shapes, types we compute), before anything is read:
    GGUFError naming the first tensor that is missing, extra, of another shape, or of a type not served."""
    expected = expected_tensors(file, config)
    for name, shape in expected.items():
        info = file.tensors.get(name)
        if info is None:
            raise GGUFError(f"{file.path}: the file has no tensor {name!r}, which a {config.model_type} model of "
                            f"this configuration needs")
        if tuple(info.shape) != shape:
            raise GGUFError(f"{file.path}: tensor {name!r} has shape {tuple(info.shape)}, the metadata says {shape}")
        norm_or_bias = len(shape) == 1
        if info.type_id not in FLOAT_TYPES and (norm_or_bias or info.type_id not in quant.BY_TYPE):
            served = "F32, F16, BF16" if norm_or_bias else ", ".join([*sorted(quant.FORMATS), "F32", "F16", "BF16"])
            raise GGUFError(f"{file.path}: tensor {name!r} is {type_name(info.type_id)}, a type not served for it "
                            f"(served: {served})")
    unused = [name for name in file.tensors if name not in expected]
    if unused:
        names = ", ".join(repr(n[:80]) for n in unused[:5])
        raise GGUFError(f"{file.path}: {len(unused)} tensor(s) have no place in a {config.model_type} model: {names}")


class _Placer:
    """Puts the file's tensors into the model's modules, noting which tensors found a place."""

    def __init__(self, file: GGUFFile, model: nn.Module, config: Any, family: Family, dtype: torch.dtype):
        self.file, self.model, self.config, self.family, self.dtype = file, model, config, family, dtype
        self.used: set[str] = set()

    def info(self, name: str) -> TensorInfo:
        info = self.file.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.file.path}: the file has no tensor {name!r}, which a "
                            f"{self.config.model_type} model of this configuration needs")
        self.used.add(name)
        return info

    def optional(self, name: str) -> TensorInfo | None:
        return self.info(name) if name in self.file.tensors else None

    def set(self, path: str, module: nn.Module) -> None:
        parent_path, _, leaf = path.rpartition(".")
        setattr(self.model.get_submodule(parent_path) if parent_path else self.model, leaf, module)

    def norm(self, name: str, path: str, size: int) -> None:
        norm = self.model.get_submodule(path)
        weight = _float(self.file, self.info(name), (size,), self.dtype)
        norm.weight = nn.Parameter(weight, requires_grad=False)

    def layer(self, i: int) -> None:
        c = self.config
        head_dim = c.head_dim
        q_rows, kv_rows = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
        shapes = {"attn_q": (q_rows, c.hidden_size), "attn_k": (kv_rows, c.hidden_size),
                  "attn_v": (kv_rows, c.hidden_size), "attn_output": (c.hidden_size, q_rows),
                  "ffn_gate": (c.intermediate_size, c.hidden_size), "ffn_up": (c.intermediate_size, c.hidden_size),
                  "ffn_down": (c.hidden_size, c.intermediate_size)}
        layer_path = f"model.layers.{i}"
        for short, path in LAYER_LINEARS.items():
            name = f"blk.{i}.{short}"
            rows = None
            if self.family.interleaved_qk and short in ("attn_q", "attn_k"):
                rows = _interleaved_rows((q_rows if short == "attn_q" else kv_rows) // head_dim, head_dim)
            bias_info = self.optional(f"{name}.bias")
            module: Any = self.model.get_submodule(f"{layer_path}.{path}")
            if (bias_info is not None) != (getattr(module, "bias", None) is not None):
                raise GGUFError(f"{self.file.path}: tensor {name}.bias is {'present' if bias_info else 'missing'}, "
                                f"which a {c.model_type} model does not expect")
            bias = None
            if bias_info is not None:
                bias = _float(self.file, bias_info, (shapes[short][0],), self.dtype)
                bias = bias if rows is None else bias[rows]
            self.set(f"{layer_path}.{path}", _linear(self.file, self.info(f"{name}.weight"), shapes[short], self.dtype,
                                                     rows, bias))
        for short, path in LAYER_NORMS.items():
            try:
                self.model.get_submodule(f"{layer_path}.{path}")
            except AttributeError:
                continue  # (q/k norms: Qwen3's only)
            size = head_dim if short in ("attn_q_norm", "attn_k_norm") else c.hidden_size
            self.norm(f"blk.{i}.{short}.weight", f"{layer_path}.{path}", size)

    def embeddings(self) -> None:
        c = self.config
        shape = (c.vocab_size, c.hidden_size)
        info = self.info("token_embd.weight")
        if info.type_id in FLOAT_TYPES:
            embedding = nn.Embedding(c.vocab_size, c.hidden_size, dtype=self.dtype)
            with torch.no_grad():
                embedding.weight.copy_(_float(self.file, info, shape, self.dtype))
            embedding.requires_grad_(False)
            self.set("model.embed_tokens", embedding)
            head: nn.Module = nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=self.dtype)
            head.weight = embedding.weight  # (tied: the same tensor)
        else:
            table = _quantized(self.file, info, shape)
            self.set("model.embed_tokens", QuantizedEmbedding(table, self.dtype))
            head = QuantizedLinear(table)  # (tied: the same blocks)
        output = self.optional("output.weight")
        if output is not None:
            head = _linear(self.file, output, shape, self.dtype, None, None)
        self.set("lm_head", head)
        self.norm("output_norm.weight", "model.norm", c.hidden_size)

    def rotary(self) -> None:
        rotary_module = self.model.get_submodule("model.rotary_emb")
        rotary = type(rotary_module)(config=self.config)  # (built on the CPU: the meta one has no frequencies)
        factors = self.optional("rope_freqs.weight")
        if factors is not None:
            half = self.config.head_dim // 2
            scale = _float(self.file, factors, (half,), torch.float32)
            if not torch.isfinite(scale).all() or (scale <= 0).any():
                raise GGUFError(f"{self.file.path}: rope_freqs.weight holds values that are not positive numbers")
            frequencies = cast(torch.Tensor, rotary.inv_freq) / scale
            rotary.inv_freq = frequencies
            rotary.original_inv_freq = frequencies.clone()
        self.set("model.rotary_emb", rotary)


def build_model(file: GGUFFile, config: DecoderConfig, dtype: torch.dtype, reference: bool = False) -> nn.Module:
    """The family's causal LM of ``config`` with the file's tensors in place (every tensor used, every weight
    filled: else GGUFError): our module tree (``llm_api.model.decoder_weights``), which the owned decoder runs, or with
    ``reference`` transformers' classes of the family, whose ``generate()`` is the reference path."""
    family = FAMILIES[file.metadata["general.architecture"]]
    check_tensors(file, config)  # (all of it before a byte is copied)
    model: Any
    placed: Any = config
    if reference:
        from transformers import AutoModelForCausalLM

        placed = config.to_transformers()
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(placed, dtype=dtype)
    else:
        model = CausalLMWeights(config, dtype)
    placer = _Placer(file, model, placed, family, dtype)
    for i in range(config.num_hidden_layers):
        placer.layer(i)
    placer.embeddings()
    placer.rotary()
    unused = [name for name in file.tensors if name not in placer.used]
    if unused:
        names = ", ".join(repr(n[:80]) for n in unused[:5])
        raise GGUFError(f"{file.path}: {len(unused)} tensor(s) have no place in a {config.model_type} model: {names}")
    empty = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if empty:
        raise GGUFError(f"{file.path}: no tensor for {', '.join(empty[:5])}")
    return model.eval()


def tokenizer_for(file: GGUFFile, cache_dir: Path) -> Any:
    """The file's tokenizer as llama.cpp reads it (``llm_api.model.gguf_tokenizer``); for a vocabulary that module
    does not build, transformers' conversion, kept once per file's metadata under ``cache_dir`` and read from there
    by ``llm_api.model.tokenizer`` (``converted_tokenizer``: ours once it reads back as the same)."""
    built = build_tokenizer(file)
    if not isinstance(built, str):
        return built
    logger.info("%s: the tokenizer is transformers' conversion (%s)", file.path.name, built)
    folder = Path(cache_dir) / "gguf-tokenizers" / file.metadata_digest()[:32]
    return converted_tokenizer(folder, lambda: _convert_tokenizer(file, folder))


def _convert_tokenizer(file: GGUFFile, folder: Path) -> Any:
    from transformers import AutoTokenizer

    logger.info("converting the tokenizer of %s (once; kept in %s)", file.path.name, folder)
    try:
        return AutoTokenizer.from_pretrained(file.path.parent, gguf_file=file.path.name)
    except Exception as error:  # (transformers' converter: a vocabulary it cannot read)
        raise GGUFError(f"{file.path}: its tokenizer could not be read ({type(error).__name__}: "
                        f"{str(error)[:200]})") from None


def check_served(settings: Any, on_gpu: bool, path: Path) -> None:
    """The settings a GGUF model cannot run with: ConfigError naming them, before anything is read."""
    if settings.quantization != "none":
        raise ConfigError(f"MODEL_PATH={str(path)!r} is a GGUF file, whose weights are already quantized: unset "
                          f"QUANTIZATION={settings.quantization} (it quantizes Hugging Face checkpoints at load)")
    if on_gpu:
        raise ConfigError(f"MODEL_PATH={str(path)!r}: GGUF files are served on the CPU (DEVICE_MAP=cpu); their "
                          f"quantized products have no GPU kernels yet")
    if not cpu_library.load(settings.cache_dir):
        raise ConfigError(f"MODEL_PATH={str(path)!r}: a GGUF model needs the CPU kernels, which did not build or "
                          f"load here (a C compiler, cc or gcc, is needed; the log says why)")
