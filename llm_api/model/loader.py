"""Load the tokenizer and causal LM that ``Settings`` describe.

Turns DTYPE, DEVICE_MAP, QUANTIZATION (with BNB_4BIT_QUANT_TYPE) and OFFLOAD_FOLDER into
``from_pretrained`` arguments (and, on a CPU, CPU_PACKED_WEIGHTS into oneDNN-packed linear layers:
``llm_api.model.packed_linear``), and fails with a ``ConfigError`` naming the variables when a combination
cannot work on this machine (checked before loading, by trying the operation where that is the only
honest test). The tokenizer gets a pad token (falling back to EOS) and left padding, which batched
``generate()`` needs. ``LoadedModel.device`` is where input ids go: the input embedding's execution
device, which differs from its weight's device when accelerate offloads it.

Who reads the weights: a GGUF file, always llm_api (``llm_api.model.gguf_model``); a checkpoint of a family the
engine runs as its own code, llm_api too where the paged engine runs it on a CPU (``llm_api.model.checkpoint_model``,
into our module tree; what it does not take is logged with the reason); everything else transformers'
``from_pretrained``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, cast

import torch

from llm_api.kernels import interpreter_enabled
from llm_api.kernels.cpu import library as cpu_kernels_library
from llm_api.kernels.cpu.quant import INPUT_DIGITS
from llm_api.layers.quantized import input_digits_for, set_input_digits
from llm_api.model import cpu
from llm_api.model.host_memory import release_freed_heap
from llm_api.model.packed_linear import pack_linear_weights, weight_layout
from llm_api.model.split_linear import MAX_SPLIT_ROWS, split_linear_weights
from llm_api.model.settings import BITSANDBYTES_SCHEMES, ConfigError, Settings, check_model_path, parse_device_map
from llm_api.model.checkpoint_model import checkpoint_config, checkpoint_dtype, load_weights
from llm_api.model.decoder_config import DecoderConfig
from llm_api.model.gguf_file import type_name
from llm_api.model.placement import execution_device
from llm_api.model.quantize import SCHEMES, quantize_model
from llm_api.model.tokenizer import Tokenizer, converted_tokenizer, folder_digest, load_tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LoadedModel:
    tokenizer: Any  # ours (llm_api.model.tokenizer.Tokenizer), or transformers' for a layout we do not read
    model: torch.nn.Module
    eos_token_ids: frozenset[int]
    hidden_size: int
    device: torch.device  # where input ids and embeddings go (the input embedding's device)


def resolve_dtype(settings: Settings, checkpoint_dtype: torch.dtype | str | None, on_gpu: bool) -> torch.dtype:
    """DTYPE -> torch dtype; ``auto``: the checkpoint's, but float32 on CPU for float16 checkpoints. DTYPE not
    set: bfloat16, except on a CPU without bfloat16 matrix instructions (``llm_api.model.cpu``), where it is
    float32 (said in one log line). A DTYPE that is set is always used."""
    if settings.dtype != "auto":
        dtype = _DTYPES[settings.dtype]
        if dtype == torch.bfloat16 and not settings.dtype_from_env and not on_gpu and not cpu.has_native_bf16():
            logger.info("DTYPE not set: using float32, since this CPU has no bfloat16 matrix instructions "
                        "(avx512_bf16, amx_bf16 or arm bf16); set DTYPE=bfloat16 to use it anyway")
            return torch.float32
        return dtype
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = _DTYPES.get(checkpoint_dtype.removeprefix("torch."))
    dtype = checkpoint_dtype if checkpoint_dtype is not None and checkpoint_dtype in _DTYPES.values() else torch.float32
    if not on_gpu and dtype == torch.float16:
        return torch.float32  # CPUs have no float16 arithmetic: every op converts (see docs/model-options.md)
    return dtype


def check_cpu_dtype(dtype: torch.dtype) -> None:
    """Fail with a ConfigError when this CPU build cannot run a decoder's ops in ``dtype``: try them."""
    try:
        x = torch.randn(2, 4, 8).to(dtype)
        w = torch.randn(8, 8).to(dtype)
        y = torch.nn.functional.linear(x, w)
        torch.nn.functional.scaled_dot_product_attention(y[None], y[None], y[None], is_causal=True)
        torch.nn.functional.silu(y).softmax(-1).pow(2).mean(-1, keepdim=True).rsqrt()
        torch.nn.functional.embedding(torch.tensor([0, 1]), w)
    except RuntimeError as exc:
        raise ConfigError(f"DTYPE={_name(dtype)} does not run on this CPU build of torch ({exc}); "
                          f"use DTYPE=float32 or bfloat16, or a GPU (DEVICE_MAP)") from None


def quantization_config(settings: Settings, compute_dtype: torch.dtype, on_gpu: bool, device_map=None):
    """QUANTIZATION -> a BitsAndBytesConfig (None for none and for the GGUF formats, ``llm_api.model.quantize``);
    ConfigError for what bitsandbytes rejects."""
    if settings.quantization not in BITSANDBYTES_SCHEMES:
        return None
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        raise ConfigError(
            f"QUANTIZATION={settings.quantization} needs bitsandbytes: pip install 'llm_api[quant]'"
        ) from None
    if isinstance(device_map, dict) and "disk" in device_map.values():
        raise ConfigError(f"QUANTIZATION={settings.quantization} cannot offload to disk: remove the \"disk\" "
                          f"entries of DEVICE_MAP or set QUANTIZATION=None")
    if settings.quantization == "8bit":
        # (bitsandbytes 0.50 runs int8 on CPU with float16, bfloat16 and float32 activations: nothing to refuse.)
        # A JSON map that keeps some modules on the CPU of a GPU machine: those stay unquantized float32.
        cpu_offload = on_gpu and isinstance(device_map, dict) and "cpu" in device_map.values()
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_enable_fp32_cpu_offload=cpu_offload)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=settings.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def _triton_hidden(hide: bool) -> Iterator[None]:
    """While loading on a machine that will run no Triton kernel, ``import triton`` fails.

    Why: transformers' model modules import ``torch._dynamo``, which imports Triton only to learn whether it is
    installed (and caches the answer). That import alone keeps 73 MB resident (libtriton and its Python
    modules; 2-core AMD EPYC, 2026-11-26), in a CPU server that never launches a kernel: its attention is the
    torch backend, and xgrammar's CPU masks are its own C++. Triton kernels run on CUDA, or on a CPU under
    Triton's interpreter (``llm_api.kernels.interpreter_enabled``, the kernel tests): then nothing is hidden.
    An import that happened before (a process that already used Triton) is left as it is."""
    if not hide or "triton" in sys.modules:
        yield
        return
    sys.modules["triton"] = None  # type: ignore[assignment]  # (import raises ImportError: "not installed")
    try:
        yield
    finally:
        if sys.modules.get("triton", 0) is None:
            del sys.modules["triton"]


def _cpu_kernels_ahead(settings: Settings, on_gpu: bool) -> bool:
    """The paged engine will run this CPU model's decoder layers with ``llm_api.kernels.cpu``'s products
    (FUSED_KERNELS on and the library builds: built here, once per host, so the layout can be chosen for it).
    With LoRA too: a decode step's layers run whole with the adapters' deltas in C (``llm_api.models.whole_layers``)."""
    if on_gpu or not settings.fused_kernels or settings.engine != "paged" or settings.cpu_packed_weights != "auto":
        return False
    from llm_api.kernels import cpu as cpu_kernels

    return cpu_kernels.load(settings.cache_dir)


def load(settings: Settings) -> LoadedModel:
    gguf = check_model_path(settings.model_path)
    path = Path(settings.model_path)
    device_map = parse_device_map(settings.device_map)
    cuda = torch.cuda.is_available()
    with _triton_hidden(not cuda and not interpreter_enabled()):
        if gguf is not None:
            return _load_gguf(settings, gguf, cuda and device_map != "cpu")
        return _load(settings, path, device_map, cuda)


def _load_gguf(settings: Settings, path: Path, on_gpu: bool) -> LoadedModel:
    """A GGUF file served as it is (``llm_api.model.gguf_model``): checked settings, then the file."""
    from llm_api.model import gguf_model
    from llm_api.model.gguf_file import GGUFFile

    gguf_model.check_served(settings, on_gpu, path)
    dtype = resolve_dtype(settings, None, on_gpu=False)
    check_cpu_dtype(dtype)
    with GGUFFile.open(path) as file:
        config = gguf_model.gguf_config(file)
        tokenizer = gguf_model.tokenizer_for(file, Path(settings.cache_dir))
        # (ENGINE=generate runs transformers' generate(): its classes; the paged engine runs our decoder)
        model = gguf_model.build_model(file, config, dtype, reference=settings.engine != "paged")
        formats = Counter(type_name(info.type_id) for info in file.tensors.values())
    activations = _set_input_digits(model, settings)
    _pad_left(tokenizer)
    release_freed_heap()
    logger.info("loaded %s: GGUF (%s), dtype=%s (%s)", path.name, ", ".join(f"{n} {t}" for t, n in formats.most_common()),
                dtype, activations)
    return _loaded(model, tokenizer)


def _owned_config(settings: Settings, path: Path, device_map, on_gpu: bool) -> DecoderConfig | None:
    """Our configuration of the checkpoint where the paged engine will run it on a CPU from our tree
    (``llm_api.model.checkpoint_model``), else None: transformers loads it (the reason logged)."""
    if on_gpu or device_map not in ("auto", "cpu") or settings.engine != "paged" or settings.quantization in BITSANDBYTES_SCHEMES:
        return None  # (CUDA placement, offload, bitsandbytes, generate(): transformers' loading and classes)
    config, reason = checkpoint_config(path)
    if config is None:
        logger.info("loading %s with transformers' classes: %s", path.name, reason)
    return config


def _checkpoint_tokenizer(path: Path, owned: DecoderConfig | None, cache_dir: Path) -> Any:
    """The checkpoint's tokenizer: ours (``llm_api.model.tokenizer``) where tokenizer.json alone makes it; else
    what transformers' ``AutoTokenizer`` builds, kept in the cache (``checkpoint-tokenizers/<digest of the
    tokenizer's files>``) and read by us from there once it reads back as the same tokenizer."""
    reads = load_tokenizer(path)
    if isinstance(reads, Tokenizer):
        return reads
    folder = Path(cache_dir) / "checkpoint-tokenizers" / folder_digest(path)
    logger.info("the tokenizer of %s is transformers' build (%s), kept in %s", path.name, reads, folder)
    return converted_tokenizer(folder, lambda: _transformers_tokenizer(path, owned))


def _transformers_tokenizer(path: Path, owned: DecoderConfig | None) -> Any:
    """``AutoTokenizer``'s. Given no config, AutoTokenizer loads the model's through AutoConfig, whose family class
    imports transformers' modeling stack (torch._dynamo, sympy: what our tree avoids, ``llm_api.model.
    decoder_config``); where tokenizer_config.json names the tokenizer's class (and no remote code),
    AutoTokenizer reads nothing of the config but its ``model_type``, so a bare config of that type is given."""
    from transformers import AutoTokenizer

    names_class = False
    if owned is not None:
        with contextlib.suppress(OSError, ValueError):
            tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
            names_class = (isinstance(tokenizer_config, dict) and isinstance(tokenizer_config.get("tokenizer_class"), str)
                           and "auto_map" not in tokenizer_config)
    if owned is None or not names_class:
        return AutoTokenizer.from_pretrained(path)
    from transformers import PreTrainedConfig

    config = PreTrainedConfig()
    config.model_type = owned.model_type
    return AutoTokenizer.from_pretrained(path, config=config)


def _load(settings: Settings, path: Path, device_map, cuda: bool) -> LoadedModel:
    if not cuda and _wants_cuda(device_map):
        raise ConfigError(f"DEVICE_MAP={settings.device_map!r} asks for CUDA, but no CUDA device is available")
    on_gpu = cuda and device_map != "cpu"
    owned = _owned_config(settings, path, device_map, on_gpu)
    if owned is not None:
        saved_dtype: Any = checkpoint_dtype(path)
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        saved_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = resolve_dtype(settings, saved_dtype, on_gpu)
    if not on_gpu:
        check_cpu_dtype(dtype)
    kwargs = {"dtype": dtype, "device_map": device_map}
    if isinstance(device_map, dict) and "disk" in device_map.values():
        Path(settings.offload_folder).mkdir(parents=True, exist_ok=True)
        kwargs["offload_folder"] = settings.offload_folder
    quant = quantization_config(settings, dtype, on_gpu, device_map)
    if quant is not None:
        kwargs["quantization_config"] = quant

    if settings.quantization in SCHEMES and (on_gpu or not cpu_kernels_library.load(settings.cache_dir)):
        raise ConfigError(f"QUANTIZATION={settings.quantization} runs on the CPU kernels: " + (
            "set DEVICE_MAP=cpu (no GPU kernels for these formats yet)" if on_gpu else
            "they did not build or load here (a C compiler, cc or gcc, is needed; the log says why)"))
    tokenizer = _checkpoint_tokenizer(path, owned, Path(settings.cache_dir))
    _pad_left(tokenizer)
    model: Any = load_weights(path, owned, dtype) if owned is not None else None
    if isinstance(model, str):
        logger.info("loading %s with transformers' classes: %s", path.name, model)
    if not isinstance(model, torch.nn.Module):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.eval()
    if settings.quantization in SCHEMES:
        counts = quantize_model(model, settings.quantization, dtype)
        activations = _set_input_digits(model, settings)
        logger.info("QUANTIZATION=%s: %s (%s)", settings.quantization, ", ".join(f"{n} {f}" for f, n in sorted(counts.items())),
                    activations)
    layout = "plain" if quant is not None or settings.quantization in SCHEMES else weight_layout(
        settings.cpu_packed_weights, dtype, on_cpu=not on_gpu, cpu_kernels=_cpu_kernels_ahead(settings, on_gpu))
    if layout == "packed":
        packed = pack_linear_weights(model)
        if packed:
            logger.info("CPU_PACKED_WEIGHTS=%s: %d linear layers packed for oneDNN", settings.cpu_packed_weights, packed)
    elif layout == "split":
        split = split_linear_weights(model)
        if split:
            logger.info("CPU_PACKED_WEIGHTS=%s: %d linear layers' products of up to %d rows split across %d threads",
                        settings.cpu_packed_weights, split, MAX_SPLIT_ROWS, torch.get_num_threads())
    release_freed_heap()  # the checkpoint's tensors and replaced weights (llm_api.model.host_memory)
    logger.info(
        "loaded %s: dtype=%s device_map=%s quantization=%s%s", path.name, dtype, settings.device_map,
        settings.quantization, f" ({settings.bnb_4bit_quant_type})" if settings.quantization == "4bit" else "",
    )
    return _loaded(model, tokenizer)


def _set_input_digits(model: torch.nn.Module, settings: Settings) -> str:
    """QUANT_ACTIVATIONS applied to every quantized linear; what was chosen, for the load's log line (after the
    dtype, which log readers take as the word after ``dtype=``)."""
    digits = input_digits_for(model, settings.quant_activations)
    set_input_digits(model, digits)
    name = next(name for name, value in INPUT_DIGITS.items() if value == digits)
    return f"QUANT_ACTIVATIONS={settings.quant_activations}" + (f": {name}" if settings.quant_activations == "auto" else "")


def _pad_left(tokenizer: Any) -> None:
    """A pad token (EOS where the tokenizer has none) and left padding: what batched ``generate()`` needs."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"


def _loaded(model: torch.nn.Module, tokenizer: Any) -> LoadedModel:
    return LoadedModel(
        tokenizer=tokenizer,
        model=model,
        eos_token_ids=eos_token_ids(model, tokenizer),
        hidden_size=cast(int, model.get_input_embeddings().embedding_dim),  # type: ignore[operator, union-attr]
        device=execution_device(model, model.get_input_embeddings()),  # type: ignore[operator, arg-type]
    )


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    # (transformers' models: their generation config; ours: the config, read from the GGUF file's metadata)
    eos = getattr(getattr(model, "generation_config", None) or model.config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _wants_cuda(device_map) -> bool:
    if isinstance(device_map, int):
        return True
    if isinstance(device_map, str):
        return device_map.startswith("cuda")
    if isinstance(device_map, dict):
        return any(isinstance(d, int) or str(d).startswith("cuda") for d in device_map.values())
    return False
