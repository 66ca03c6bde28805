"""GGUF files of tiny random models for the tests: written with the gguf package's ``GGUFWriter`` as llama.cpp's
converter would write them (tensor names, metadata keys, Llama's q/k rows interleaved for llama.cpp's rotary),
with a tokenizer of 262 tokens (GPT-2's byte alphabet, three specials and three merges), and each linear weight
quantized by ``llm_api.kernels.cpu.quant`` into the format asked for.

``reference_model(model, file_types)`` is the same transformers model with every quantized weight replaced by
its de-quantized values: what a served GGUF model must compute, up to its inputs' quantization."""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from llm_api.kernels.cpu import quant
from quant_helpers import random_blocks


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_alphabet(), "Ġt", "he", "Ġthe"]
VOCAB = len(TOKENS)  # 262
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_COMMON = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
               vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, rope_theta=10000.0)
CONFIGS = {"llama": lambda tied: LlamaConfig(**_COMMON, tie_word_embeddings=tied),
           "qwen2": lambda tied: Qwen2Config(**_COMMON, tie_word_embeddings=tied),
           "qwen3": lambda tied: Qwen3Config(**_COMMON, head_dim=64, tie_word_embeddings=tied)}

LINEARS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm"}


def tiny_model(arch: str, tied: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch](tied), dtype=torch.float32).eval()
    with torch.no_grad():  # (norms and biases away from their defaults, so a misplaced one shows)
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def _interleave(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's order of a q or k weight's rows (each head's two halves interleaved)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tensor(writer: gguf.GGUFWriter, name: str, weight: torch.Tensor, file_type: str) -> torch.Tensor:
    """Adds ``weight`` as ``file_type`` (a block format, or F32 / F16); returns what it holds as float32."""
    weight = weight.detach().float().contiguous()
    if file_type in ("F32", "F16"):
        dtype = np.float32 if file_type == "F32" else np.float16
        writer.add_tensor(name, weight.numpy().astype(dtype))
        return torch.from_numpy(weight.numpy().astype(dtype).astype(np.float32))
    fmt = quant.FORMATS[file_type]
    if fmt.name in quant.QUANTIZABLE:
        blocks = quant.quantize(weight, fmt)
    else:  # (random blocks: the reference holds whatever values they are)
        rng = np.random.default_rng(weight.shape[0] * 131 + weight.shape[1])
        blocks = quant.QuantizedWeight(fmt, random_blocks(fmt, weight.shape[0], weight.shape[1], rng), weight.shape[1])
    writer.add_tensor(name, blocks.blocks.numpy(), raw_shape=blocks.blocks.shape,
                      raw_dtype=gguf.GGMLQuantizationType(fmt.type_id))
    return quant.dequantize(blocks)


def write_gguf(path: Path, model, arch: str, linear_type: str = "Q8_0", embedding_type: str = "Q8_0",
               head_type: str = "Q6_K", types: dict[str, str] | None = None, metadata: dict | None = None,
               skip: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None,
               raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None) -> dict[str, torch.Tensor]:
    """``model`` as a GGUF file of ``arch`` at ``path``: linears in ``linear_type`` (``types``: per GGUF tensor name),
    the embedding in ``embedding_type``, an untied head in ``head_type``; ``metadata`` overrides keys (None: drops
    one), ``skip`` leaves tensors out, ``extra`` adds raw F32 tensors, ``raw`` writes a tensor's bytes as a given
    type in place of its weight (a format we do not compute). Returns every weight's values as the file
    holds them (HF names, float32, q/k rows in transformers' order)."""
    config = model.config
    types = types or {}
    writer = gguf.GGUFWriter(str(path), arch)
    keys = {f"{arch}.block_count": config.num_hidden_layers, f"{arch}.context_length": config.max_position_embeddings,
            f"{arch}.embedding_length": config.hidden_size, f"{arch}.feed_forward_length": config.intermediate_size,
            f"{arch}.attention.head_count": config.num_attention_heads,
            f"{arch}.attention.head_count_kv": config.num_key_value_heads,
            f"{arch}.rope.freq_base": float(config.rope_parameters["rope_theta"]),
            f"{arch}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps)}
    if arch == "qwen3":
        keys[f"{arch}.attention.key_length"] = keys[f"{arch}.attention.value_length"] = config.head_dim
    keys.update(metadata or {})
    for key, value in keys.items():
        if value is None:
            continue
        if isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    held: dict[str, torch.Tensor] = {}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def add(gguf_name: str, hf_name: str, weight: torch.Tensor, file_type: str, interleave: int = 0) -> None:
        if gguf_name in skip:
            return
        if gguf_name in (raw or {}):
            data, raw_type = (raw or {})[gguf_name]
            writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=raw_type)
            return
        stored = _interleave(weight, interleave) if interleave else weight
        values = _tensor(writer, gguf_name, stored, types.get(gguf_name, file_type))
        if interleave:  # (back in transformers' order: the inverse interleave)
            rows = values.shape[0]
            values = values.reshape(interleave, rows // interleave // 2, 2, *values.shape[1:]).swapaxes(1, 2)
            values = values.reshape(rows, *weight.shape[1:])
        held[hf_name] = values

    add("token_embd.weight", "model.embed_tokens.weight", model.model.embed_tokens.weight, embedding_type)
    for i, layer in enumerate(model.model.layers):
        for path_name, short in LINEARS.items():
            module = layer.get_submodule(path_name)
            interleave = (heads if short == "attn_q" else kv_heads if short == "attn_k" else 0) if arch == "llama" else 0
            add(f"blk.{i}.{short}.weight", f"model.layers.{i}.{path_name}.weight", module.weight, linear_type, interleave)
            if module.bias is not None:
                add(f"blk.{i}.{short}.bias", f"model.layers.{i}.{path_name}.bias", module.bias, "F32", interleave)
        for path_name, short in NORMS.items():
            try:
                norm = layer.get_submodule(path_name)
            except AttributeError:
                continue
            add(f"blk.{i}.{short}.weight", f"model.layers.{i}.{path_name}.weight", norm.weight, "F32")
    add("output_norm.weight", "model.norm.weight", model.model.norm.weight, "F32")
    if not config.tie_word_embeddings:
        add("output.weight", "lm_head.weight", model.lm_head.weight, head_type)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def reference_model(model, held: dict[str, torch.Tensor]):
    """``model`` holding the file's values (de-quantized) in float32."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, values in held.items():
            reference.get_parameter(name).copy_(values)
        if model.config.tie_word_embeddings:
            reference.lm_head.weight = reference.model.embed_tokens.weight
    return reference.eval()
