"""Settings, declared once and built once from the environment.

Contract:

- Each setting is one field of ``Settings``, declared with ``setting(...)``: its environment variable, its
  default, its bounds or allowed values and its doc (the README's "values" column); the field's annotation
  is its type. How a declaration reads its variable, and the parsers of the values with a shape of their own
  (keys, adapters, device maps, ...), are ``llm_api.model.setting_values``'. Everything else is made from
  these declarations: ``Settings.from_env`` reads and validates every variable, ``readme_table()`` writes
  the README's table of variables (scripts/settings_table.py puts it between the README's markers, and
  tests/test_config.py fails while the README is stale), and the sub-configs
  (``llm_api.engine.engine.EngineConfig``, ...) take their defaults from ``Settings``' class attributes
  instead of repeating them. A field declared without ``setting`` is derived, not a variable
  (``DERIVED_FIELDS``). A setting declared with a ``flag`` is also an option of ``llm_api serve``
  (``llm_api.server.cli`` adds one per such declaration); a flag given is read as the variable would be and
  wins over it (``from_env``'s ``flags``), and the README's row names both.
- This is the only module of ``llm_api`` that reads ``os.environ``; tests/test_architecture.py enforces it
  and lists the exceptions, each with its reason where it is made.
- A bad value raises ``ConfigError`` naming the variable and its allowed values, so it stops the model from
  loading with a message a user can act on. Tests build settings from a plain dict.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from llm_api.model.setting_values import (
    MIN_API_KEY_CHARS, ConfigError, Setting, api_key_priorities, check_device_map,
    parse_api_key, parse_lora_adapters, parse_marker, parse_store_path, served_model_names, setting, split_api_keys,
    tls_file_parser)

DEFAULT_MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
# A byte bound below one small entry would refuse every response; 1 KiB is still tiny.
MIN_RESPONSES_STORE_BYTES = 1024


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where prepared models and measured step budgets live (outside git): $LLM_API_CACHE, else ~/.cache/llm_api."""
    env = os.environ if env is None else env
    if env.get("LLM_API_CACHE"):
        return Path(env["LLM_API_CACHE"])
    return Path(env.get("HOME", str(Path.home()))) / ".cache" / "llm_api"


def default_model_path(env: Mapping[str, str] | None = None) -> Path:
    """The embedded model served by default: the wheel's GGUF file in the cache dir (``env``: the process's
    environment when None; ``llm_api.model.embedded.prepare_gguf`` puts it there)."""
    return default_cache_dir(env) / "models" / f"{DEFAULT_MODEL_DIR_NAME}.Q4_1.gguf"


# Raw QUANTIZATION values read as its first choice, "none" (the setting's aliases, and served_default_path's).
QUANTIZATION_OFF_ALIASES = ("", "null", "no", "off")
BITSANDBYTES_SCHEMES = ("8bit", "4bit")  # (the QUANTIZATION values bitsandbytes runs, under transformers' loading)


def served_default_path(env: Mapping[str, str] | None = None) -> Path:
    """What MODEL_PATH unset serves: the embedded model's GGUF file, or where QUANTIZATION asks to quantize a
    checkpoint at load, its float32 checkpoint (a GGUF file's weights are quantized already). scripts/setup.sh
    asks it which of the two to prepare."""
    env = os.environ if env is None else env
    quantizing = env.get("QUANTIZATION", "").strip().lower() not in ("none", *QUANTIZATION_OFF_ALIASES)
    return default_checkpoint_path(env) if quantizing else default_model_path(env)


def default_checkpoint_path(env: Mapping[str, str] | None = None) -> Path:
    """The embedded model as a Hugging Face checkpoint folder (its weights de-quantized into float32), for what
    needs transformers' own loading (``llm_api.model.embedded.prepare``)."""
    return default_cache_dir(env) / "models" / "float32" / DEFAULT_MODEL_DIR_NAME


def find_gguf(path: Path) -> Path | None:
    """The GGUF file MODEL_PATH names: the path itself (``*.gguf``), or the one ``*.gguf`` in a folder without a
    ``config.json``; None for anything else (a Hugging Face checkpoint folder, or nothing). Several GGUF files in
    the folder: a ``ConfigError`` naming them (which one is meant cannot be guessed)."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(files) > 1:
        names = ", ".join(repr(p.name) for p in files[:5])
        raise ConfigError(f"MODEL_PATH={str(path)!r} holds several GGUF files ({names}): name the file itself")
    return files[0] if files else None


def check_model_path(raw: str) -> Path | None:
    """MODEL_PATH names a Hugging Face checkpoint folder (None) or a GGUF file (its path); else a ConfigError."""
    path = Path(raw)
    gguf = find_gguf(path)
    if gguf is None and not (path / "config.json").is_file():
        raise ConfigError(f"MODEL_PATH={raw!r} is neither a Hugging Face checkpoint folder (no config.json) nor a "
                          f"GGUF file (*.gguf, or a folder holding one)")
    return gguf


def _model_name(raw: str) -> str:
    if not raw.strip():
        raise ConfigError("MODEL_NAME must not be empty")
    return raw


def _model_path(env: Mapping[str, str], earlier: Mapping[str, Any]) -> str:
    """MODEL_PATH, else the embedded model as ``served_default_path`` says."""
    return env.get("MODEL_PATH", "") or str(served_default_path(env))


def _cache_dir(env: Mapping[str, str], earlier: Mapping[str, Any]) -> str:
    return str(default_cache_dir(env))


def _offload_folder(env: Mapping[str, str], earlier: Mapping[str, Any]) -> str:
    return env.get("OFFLOAD_FOLDER", "") or str(default_cache_dir(env) / "offload" / earlier["model_name"])


def _lora_adapters_setting(env: Mapping[str, str], earlier: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return parse_lora_adapters(env.get("LORA_ADAPTERS", ""))


@dataclass(frozen=True)
class Settings:
    model_name: str = setting("MODEL_NAME", "smollm2", "name of the archive and of the `/predictions/<name>` path",
                              parse=_model_name)
    served_model_names: tuple[str, ...] = setting(
        "SERVED_MODEL_NAME", (), "more names the model answers to in `model` (aliases, separated by commas or "
        "spaces; vLLM's `--served-model-name`): every route takes any of them and `/v1/models` lists each; answers "
        "name the one asked", derive=served_model_names)
    model_path: str = setting(
        "MODEL_PATH", "", "a local Hugging Face checkpoint folder, or a GGUF file (`*.gguf`, or a folder holding one: "
        "Llama, Qwen2 and Qwen3 families; its quantized tensors are served as they are)", derive=_model_path,
        shown_default="the embedded model's GGUF file (`~/.cache/llm_api/models/SmolLM2-135M-Instruct.Q4_1.gguf`; "
                      "with QUANTIZATION set, its float32 checkpoint, `~/.cache/llm_api/models/float32/SmolLM2-135M-Instruct`)")
    device_map: str = setting(
        "DEVICE_MAP", "auto", "`auto`, `cpu`, `cuda`, `cuda:N`, an integer, or a JSON map of module names to devices",
        parse=check_device_map)
    max_input_tokens: int = setting("MAX_INPUT_TOKENS", 2048,
                                    "prompt length limit (tokens, or `inputs_embeds` positions)", minimum=1)
    max_new_tokens: int = setting("MAX_NEW_TOKENS", 2048, "the largest `max_new_tokens` a request may ask for",
                                  minimum=1)
    # The field's default is what an unset DTYPE reads as; whether a CPU keeps it is the loader's choice
    # (llm_api.model.loader.resolve_dtype, from dtype_from_env and the CPU's instructions).
    dtype: str = setting(
        "DTYPE", "bfloat16", "`bfloat16`, `float16`, `float32`, `auto` (the checkpoint's); a value you set is always used",
        choices=("bfloat16", "float16", "float32", "auto"),
        shown_default="`bfloat16` on a GPU and on a CPU with bfloat16 matrix instructions (`avx512_bf16` or `amx_bf16` "
                      "on x86-64, `bf16` on aarch64); `float32` on any other CPU (said in one log line; "
                      "`llm_api/model/cpu.py` says why)")
    dtype_from_env: bool = False  # derived: DTYPE was set, so it is always honoured (see DERIVED_FIELDS)
    quantization: str = setting(
        "QUANTIZATION", "none",
        "`None`; `q8_0`, `q4_0`, `q4_k`: a Hugging Face checkpoint's linear layers quantized at load into GGUF's block "
        "formats, computed by the CPU kernels (docs/model-options.md: which tensors get which format); `8bit`, "
        "`4bit`: bitsandbytes (`QUANTIZATION=8bit make serve` installs it). A GGUF file is served as it is, with "
        "QUANTIZATION unset",
        choices=("none", "q8_0", "q4_0", "q4_k", "8bit", "4bit"), aliases=QUANTIZATION_OFF_ALIASES,
        shown_default="`None`")
    quant_activations: str = setting(
        "QUANT_ACTIVATIONS", "auto",
        "how the CPU kernels' products over GGUF block formats (a GGUF file's, or QUANTIZATION's `q8_0`, `q4_0`, "
        "`q4_k`) quantize their input rows, per block of 32 values: `int8x2`, two 8-bit digits a value (~13 bits: "
        "the float model's answers); `int8`, one digit, as llama.cpp's Q8_0/Q8_1 activations (llama.cpp's "
        "precision, one integer product a value instead of two: 1.3-1.7x the prefill); `auto`: `int8` for "
        "models of 1B parameters and more, `int8x2` below. docs/model-options.md compares them",
        choices=("auto", "int8x2", "int8"))
    bnb_4bit_quant_type: str = setting("BNB_4BIT_QUANT_TYPE", "nf4", "`nf4`, `fp4` (the 4-bit data type)",
                                       choices=("nf4", "fp4"))
    cpu_packed_weights: str = setting(  # llm_api.model.packed_linear
        "CPU_PACKED_WEIGHTS", "auto",
        "`auto`, `true`, `split`, `false`: how a CPU runs the linear layers' products. `true`: weights reordered once "
        "at load into oneDNN's blocked layout (+21% batch-1 decode in bfloat16 on an AMX Xeon; a tied `lm_head` costs "
        "one more copy of the embedding); `split`: products of up to 128 rows split across the cores along the "
        "output features, over the weights as loaded (+26% batch-1 decode over packed in float32 on an AMD EPYC "
        "with avx2, where one-row products otherwise run on one core); `false`: torch's `F.linear`. `auto`: "
        "the weights as loaded where the CPU kernels run their products (`FUSED_KERNELS`, LoRA included), else "
        "bfloat16 packed (a CPU without bfloat16 instructions cannot pack them and keeps `F.linear`, logged), "
        "float32 split on AMD CPUs and `F.linear` on others (MKL's float32 products use the cores on an Intel "
        "Xeon). Measured: docs/benchmarks.md, \"Where a CPU decode step goes\"",
        choices=("auto", "true", "split", "false"))
    offload_folder: str = setting(
        "OFFLOAD_FOLDER", "", "where `\"disk\"` entries of a JSON `DEVICE_MAP` keep their weights",
        derive=_offload_folder, shown_default="`$LLM_API_CACHE/offload/$MODEL_NAME`")
    end_of_stream_token: str = setting(
        "END_OF_STREAM_TOKEN", "<|endoftext|>",
        "the marker that ends every stream: 2+ characters, no line breaks, not starting with a space, digit, `-` or "
        "one of `{}[]\":,\\` (so an error object can always be written without it)", parse=parse_marker)
    reasoning_parser: str = setting(  # llm_api.text.reasoning
        "REASONING_PARSER", "auto",
        "how a reasoning model's `<think>` block is split from its answer (chat `reasoning` / `reasoning_content`; "
        "see Reasoning models): `auto` (from the chat template: DeepSeek-R1 style when the generation prompt opens "
        "`<think>`, Qwen3 style when the template writes `</think>` otherwise, none without think tags), "
        "`deepseek_r1`, `qwen3`, `none` (never split)",
        choices=("none", "auto", "deepseek_r1", "qwen3"))
    generic_tool_choice_auto: bool = setting(  # llm_api.text.tools, llm_api.service.constraints.plan_tools
        "GENERIC_TOOL_CHOICE_AUTO", True,
        "`tool_choice` `auto` (the default with tools) on a chat template without a tool-call format, in the "
        "generic form (text or a call; see Tool calls); `false` refuses it with a 400 naming `tool_choice`, as "
        "vLLM does without a tool parser")
    cache_dir: str = setting(
        "LLM_API_CACHE", "",
        "where the embedded model is prepared and measured CPU step budgets are kept (`step-budget/`), with the "
        "tokenizers transformers built for checkpoints whose tokenizer.json is not the whole tokenizer and for GGUF "
        "vocabularies without a rule in llm_api/model/gguf_tokenizer.py (`checkpoint-tokenizers/`, "
        "`gguf-tokenizers/`: read without transformers once checked equal)",
        derive=_cache_dir, shown_default="`~/.cache/llm_api`")
    engine: str = setting("ENGINE", "paged",
                          "`paged` (the engine below) or `generate` (transformers' `generate()`, the reference)",
                          choices=("paged", "generate"))
    # Paged KV cache and scheduler limits.
    kv_block_size: int = setting("KV_BLOCK_SIZE", 16, "tokens per KV-cache block", minimum=1)
    kv_cache_memory_mib: int = setting(
        "KV_CACHE_MEMORY_MIB", 0,
        "KV pool size; auto: on GPU what is left of total memory x `GPU_MEMORY_UTILIZATION` after the weights and a "
        "profiled activation peak, on CPU enough for `MAX_NUM_SEQS` requests of `MAX_INPUT_TOKENS` + `MAX_NEW_TOKENS` "
        "tokens, at most 1/32 of the host's memory (its cgroup limit where lower; 768 MiB on a 24 GiB host) and at "
        "least one such request. A CPU pool is resident only as far as it has been used (see [Memory and "
        "start-up](#memory-and-start-up))",
        minimum=0, default_note="(auto)")
    gpu_memory_utilization: float = setting(
        "GPU_MEMORY_UTILIZATION", 0.9,
        "share of the GPU's total memory the server may use (weights, activations, KV pool, CUDA graphs)",
        minimum=0.0, maximum=1.0)
    attention_backend: str = setting(
        "ATTENTION_BACKEND", "auto",
        "`auto` (Triton kernels on CUDA, torch elsewhere), `torch`, `triton` (on CPU only under `TRITON_INTERPRET=1`, "
        "for tests)",
        choices=("auto", "torch", "triton"))
    cuda_graphs: bool = setting("CUDA_GRAPHS", True,
                                "capture the decode step in CUDA graphs (GPU only); `false` runs it eagerly")
    fused_kernels: bool = setting(
        "FUSED_KERNELS", True,
        "the kernel set the owned decoder (Llama, Mistral, Qwen2/3: `llm_api/models/`) runs on: one kernel for each "
        "RMSNorm and rotary embedding, the residual sums fused into the norms, q/k/v and gate/up merged into one "
        "product each: Triton kernels on a GPU (docs/benchmarks.md \"GPU\"); on a CPU, C kernels built "
        "once per host with the system compiler (`cc`) under `LLM_API_CACHE` (`cpu-kernels/`), which also run "
        "a step's products of up to 16 rows (LoRA deltas included), its paged attention and greedy pick, a decode "
        "step's layers in one call (docs/benchmarks.md \"CPU kernels\"; no compiler: the torch set, logged); "
        "`false`: the torch set (transformers' arithmetic, op by op). Other families run transformers' classes "
        "either way")
    cuda_graph_max_batch_size: int = setting(
        "CUDA_GRAPH_MAX_BATCH_SIZE", 128,
        "largest captured decode batch (capped by `MAX_NUM_SEQS`); larger batches run eagerly", minimum=1)
    # Speculative decoding by n-gram prompt lookup (llm_api.engine.speculative).
    speculative_tokens: int = setting(
        "SPECULATIVE_TOKENS", 0,
        "speculative decoding by n-gram prompt lookup: each decoding sequence drafts up to this many tokens per step "
        "from earlier text of its own (prompt + answer), verified in one forward; greedy answers are unchanged and "
        "sampled ones keep their distribution (docs/architecture.md, \"Speculative decoding\"). Pays off where "
        "answers copy their prompt (edits, quotes, code): with `4` on a 2-core CPU, 2.7x (bfloat16) and 2.0x "
        "(float32) on such answers, 1.3x on open ones, 1.0x at 16 sequences (docs/benchmarks.md). Off by default: "
        "speculative steps run without CUDA graphs (unmeasured on a GPU), and a seeded sampled request draws other "
        "(equally distributed) tokens with it on; the paged engine only (`ENGINE=generate` ignores it)",
        minimum=0, default_note="(off)")
    ngram_min: int = setting(
        "NGRAM_MIN", 1,
        "n-gram sizes looked up, longest first (vLLM's `prompt_lookup_min` / `prompt_lookup_max`); "
        "`1 <= NGRAM_MIN <= NGRAM_MAX`", minimum=1)
    ngram_max: int = setting("NGRAM_MAX", 4, "", minimum=1, joins_previous=True)
    speculative_max_batch: int = setting(
        "SPECULATIVE_MAX_BATCH", 8,
        "no drafts on a step with more decoding sequences than this (a big batch gains less than verifying drafts "
        "costs; measured, docs/benchmarks.md \"Speculative decoding\")", minimum=0)
    max_num_seqs: int = setting("MAX_NUM_SEQS", 64, "requests decoded together at most", minimum=1)
    # Off by default: with it, a key holder can put its own requests ahead of its other ones and preempt them.
    scheduling_policy: str = setting(
        "SCHEDULING_POLICY", "fcfs",
        "`fcfs`: requests are served in arrival order, and a request's `priority` other than 0 gets a 400; "
        "`priority`: a request's `priority` (an integer, lower first, vLLM's field) orders the queue and a better "
        "priority preempts worse running requests when memory or `MAX_NUM_SEQS` is short. Priorities compare only "
        "between one key's requests (keys share the engine fairly: docs/reliability.md)", choices=("fcfs", "priority"))
    max_num_batched_tokens: int = setting(
        "MAX_NUM_BATCHED_TOKENS", 0,
        "tokens per engine step, at least `MAX_NUM_SEQS`; long prompts are prefilled in chunks of it, so it bounds "
        "how long running streams wait while a long prompt arrives. `0`: 2048 on CUDA; on a CPU the largest budget "
        "whose step takes about 0.4 s, as measured on this host with this model and these settings: read from "
        "`$LLM_API_CACHE/step-budget/` when measured before (no probe: ready seconds after the weights load), else "
        "measured at start (at most 6 s), then re-measured while the server is idle and raised if it finds more, "
        "never lowered, and never below what the model's arithmetic allows a slow core (see [Memory and "
        "start-up](#memory-and-start-up); logged with its source; set it to pin a benchmark)",
        minimum=0, default_note="(sized to the device)")
    # Behind the key by default: the series name the adapters served and count every key's requests.
    metrics_public: bool = setting(
        "METRICS_PUBLIC", False,
        "`llm_api serve` (and `--ray`) only: `true` answers `/metrics` without the key, for a scraper that cannot "
        "send one (Prometheus can: `authorization: {credentials: <key>}` in its scrape config)")
    # TorchServe's backend cannot tell a unary Predictions call from StreamPredictions, and a second message
    # to a unary call kills the worker, so this is off unless every gRPC client is trusted (docs/reliability.md).
    grpc_streaming: bool = setting(
        "GRPC_STREAMING", False,
        "TorchServe only: `true` streams gRPC answers that ask for it (see gRPC above for the risk)")
    request_timeout_s: float = setting(
        "REQUEST_TIMEOUT_S", 600.0, "deadline of every request (a request's own `timeout` may only shorten it)",
        minimum=0.0)
    # Backpressure (async mode): requests beyond these get 503 at once instead of queueing unbounded.
    max_waiting_requests: int = setting(
        "MAX_WAITING_REQUESTS", 256,
        "async mode: requests accepted beyond `MAX_NUM_SEQS`; more get 503 `overloaded` at once", minimum=0)
    max_tokens_in_flight: int = setting(
        "MAX_TOKENS_IN_FLIGHT", 1_048_576,
        "async mode: sum of prompt + `max_new_tokens` over live requests; more get 503", minimum=1)
    # The other caps bound each factor of a request's work alone; this bounds their product
    # (llm_api.service.admission.request_work).
    max_request_work: int = setting(
        "MAX_REQUEST_WORK", 262_144,
        "one request's work: prompt tokens (x `n` when echoed) + `n` x `max_new_tokens` x (1 + logprob entries per "
        "token: the alternatives asked for and the token's own), a prompt list's prompts summed; above it 400 "
        "`work_limit_exceeded` naming the limit and the request's fields, on every generate route (formula: "
        "`llm_api/service/admission.py`)", minimum=1)
    # The standalone server (llm_api serve). Its bearer keys (see api_keys), or one generated per start.
    api_key: str = setting(
        "LLM_API_KEY", "",
        f"`llm_api serve` only: its bearer keys, one or more separated by commas (any is accepted; each is its own "
        f"owner of stored responses and of a fair share of the engine), each at least {MIN_API_KEY_CHARS} visible "
        f"ASCII characters without spaces or commas (never logged); a key followed by ` priority=N` ranks its "
        f"requests against other keys' as `max(N, min(priority, 0))` (default 0: a key's priority orders only its "
        f"own requests; docs/reliability.md)",
        parse=parse_api_key, repr=False, shown_default="unset (a key is generated per start)")
    drain_grace_s: float = setting(
        "DRAIN_GRACE_S", 30.0,
        "`llm_api serve` only: seconds requests in flight may take to finish after SIGTERM (> 0)", minimum=0.0)
    max_request_bytes: int = setting(
        "MAX_REQUEST_BYTES", 6_553_500,
        "`llm_api serve` only: the largest request body (HTTP 413 above; also the gRPC message limit), TorchServe's "
        "default", minimum=1024)
    # The standalone server's transport limits (llm_api.server.transport says how each is enforced).
    keepalive_timeout_s: float = setting(
        "KEEPALIVE_TIMEOUT_S", 15.0,
        "`llm_api serve` only: a connection must deliver a complete request head within this many seconds of opening "
        "or of its previous answer, else it is closed (slow headers and idle keep-alive alike; aiohttp's "
        "`keepalive_timeout`)", minimum=0.0)
    body_timeout_s: float = setting(
        "BODY_TIMEOUT_S", 60.0,
        "`llm_api serve` only: a request's whole body must arrive within this many seconds of its head (HTTP 408 "
        "`request_timeout`, then the connection closes)", minimum=0.0)
    write_timeout_s: float = setting(
        "WRITE_TIMEOUT_S", 30.0,
        "`llm_api serve` only: each write of an answer must finish within this many seconds; a client that stopped "
        "reading has its connection and request aborted (KV blocks freed)", minimum=0.0)
    send_buffer_bytes: int = setting(
        "SEND_BUFFER_BYTES", 262_144,
        "`llm_api serve` only: the kernel send buffer per connection (`SO_SNDBUF`) of a streamed answer, so a client "
        "that stops reading holds little; `0`: the kernel's own sizing", minimum=0)
    max_connections: int = setting(
        "MAX_CONNECTIONS", 512,
        "`llm_api serve` only: connections in use by authenticated clients at once; a request with a valid key on one "
        "more first closes the idle authenticated connection least recently used, and only when all are busy gets "
        "503 `too_many_connections` with `Retry-After` (its connection closes; the probes still answer). Connections "
        "no authenticated request has used never count here: see the next two rows. Request lines and header fields "
        "are limited to 8190 bytes and 128 fields (aiohttp's parser: 400/431)", minimum=1)
    # Connections that no authenticated request has used yet (llm_api.server.connections): their own budget,
    # a cap per client address, and a deadline to start a request.
    max_untrusted_connections: int = setting(
        "MAX_UNTRUSTED_CONNECTIONS", 64,
        "`llm_api serve` only: connections that no request with a valid key has used yet (idle, half-sent, or only "
        "refused) kept at once; one more closes the oldest of them (each new connection has 0.2 s to send its head "
        "before it may be closed), so unauthenticated sockets cannot lock key holders out", minimum=1)
    max_connections_per_client: int = setting(
        "MAX_CONNECTIONS_PER_CLIENT", 128,
        "`llm_api serve` only: connections from one client address at once; one more closes that address's oldest "
        "connection not in the middle of a request (untrusted first)", minimum=1)
    header_timeout_s: float = setting(
        "HEADER_TIMEOUT_S", 5.0,
        "`llm_api serve` only: a new connection must start a request within this many seconds, else it is closed "
        "(`KEEPALIVE_TIMEOUT_S` still bounds every connection)", minimum=0.0)
    # TLS on the standalone server (llm_api.server.tls): vLLM's names, as variables and as flags.
    ssl_keyfile: str = setting(
        "SSL_KEYFILE", "",
        "`llm_api serve` only: the server's private key (PEM, not encrypted); with `SSL_CERTFILE` (both or "
        "neither) the HTTP port serves HTTPS only and the gRPC port TLS only, TLS 1.2 or later. A file that cannot "
        "be read, a key that does not match the certificate, or a CA file without a CA certificate stops the start "
        "before a port opens, naming the file (exit 2). Under `--ray`, Ray's proxy serves HTTPS with the two "
        "([docs/scale-out.md](docs/scale-out.md))",
        parse=tls_file_parser("SSL_KEYFILE"), flag="--ssl-keyfile", default_note="(plain HTTP and gRPC)",
        flag_help="the server's private key (PEM); with --ssl-certfile: HTTPS and gRPC over TLS")
    ssl_certfile: str = setting(
        "SSL_CERTFILE", "",
        "`llm_api serve` only: the server's certificate (PEM), followed by any intermediate CA certificates a client "
        "needs to reach its root", parse=tls_file_parser("SSL_CERTFILE"), flag="--ssl-certfile",
        flag_help="the server's certificate chain (PEM)")
    ssl_ca_certs: str = setting(
        "SSL_CA_CERTS", "",
        "`llm_api serve` only, with `SSL_KEYFILE`: CA certificates (PEM) for mutual TLS: a client (HTTP or gRPC, "
        "the probes too) must present a certificate signed by one of them, else its handshake is refused before any "
        "request is read; the bearer key is still required. Not with `--ray` (its proxy would not require the "
        "client's certificate)",
        parse=tls_file_parser("SSL_CA_CERTS"), flag="--ssl-ca-certs", default_note="(no client certificate asked)",
        flag_help="CA certificates (PEM) the clients' certificates must be signed by: mutual TLS")
    # Stored responses (the Responses API's store: true; llm_api.protocols.responses.store).
    responses_store_max_entries: int = setting(
        "RESPONSES_STORE_MAX_ENTRIES", 10_000,
        "stored responses (`store: true`, the Responses API's default) kept at most; the oldest is evicted first. "
        "`0`: none is kept", minimum=0)
    responses_store_max_bytes: int = setting(
        "RESPONSES_STORE_MAX_BYTES", 64 * 1024 * 1024,
        f"their size at most (>= {MIN_RESPONSES_STORE_BYTES}): the UTF-8 bytes of each response object and its "
        f"conversation, plus 560 bytes per entry (what an entry costs in memory besides its text, measured); the "
        f"oldest is evicted first, and one larger than this alone is not stored",
        minimum=MIN_RESPONSES_STORE_BYTES, default_note="(64 MiB)")
    responses_store_ttl_s: float = setting(
        "RESPONSES_STORE_TTL_S", 86_400.0,
        "seconds a stored response can be read (or continued with `previous_response_id`) after it was stored "
        "(> 0); then it is gone, on access or by a sweep each minute", minimum=0.0, default_note="(a day)")
    # One owner's (key's) share of the store: its own oldest entries are evicted first past these.
    responses_store_owner_max_entries: int = setting(
        "RESPONSES_STORE_OWNER_MAX_ENTRIES", 2_500,
        "one owner's (key's) stored responses at most (>= 1; at most `RESPONSES_STORE_MAX_ENTRIES`): past it its own "
        "oldest entries are evicted first, and when the whole store is full the oldest entry of the key holding the "
        "most goes, so one key's flood pushes out its own history, never a smaller holder's", minimum=1)
    responses_store_owner_max_bytes: int = setting(
        "RESPONSES_STORE_OWNER_MAX_BYTES", 16 * 1024 * 1024,
        f"one owner's stored bytes at most (>= {MIN_RESPONSES_STORE_BYTES}; counted as `RESPONSES_STORE_MAX_BYTES` "
        f"counts them: echoed tools and instructions included), with the same eviction; a response larger than this "
        f"alone is not stored",
        minimum=MIN_RESPONSES_STORE_BYTES, default_note="(16 MiB)")
    responses_store_path: str = setting(
        "RESPONSES_STORE_PATH", "",
        "an SQLite file (WAL, created mode 0600; give an absolute path: a relative one is taken from the process's "
        "working folder) that keeps stored responses across restarts, under the same bounds (the file holds 0.5x to "
        "1.2x the counted bytes, measured, plus a write-ahead log of at most about 4 MiB), and that several "
        "TorchServe workers of one model share; a path that cannot be opened stops the start naming this variable",
        parse=parse_store_path, default_note="(memory)")
    responses_background_per_owner: int = setting(
        "RESPONSES_BACKGROUND_PER_OWNER", 8,
        "background responses (`background: true`) one owner (key) may have in flight at once (>= 1); past it, 429 "
        "`too_many_background_responses` until one ends", minimum=1)
    # LoRA adapters (llm_api.lora, docs/lora.md): PEFT adapter folders served beside the base model, by name.
    lora_adapters: tuple[tuple[str, str], ...] = setting(
        "LORA_ADAPTERS", (),
        "`name=path,...`: PEFT LoRA adapters served beside the base model, selected by `model` (OpenAI routes) or "
        "`adapter` (native, gRPC); relative paths are read below the archive under TorchServe "
        "([docs/lora.md](docs/lora.md))", derive=_lora_adapters_setting)
    max_lora_rank: int = setting("MAX_LORA_RANK", 64,
                                 "the largest adapter rank accepted; a larger one stops the start naming the adapter",
                                 minimum=1)
    max_loras: int = setting("MAX_LORAS", 4,
                             "adapters running in one engine step; more are kept on the host and swapped in", minimum=1)
    lora_runtime_loading: bool = setting(
        "LORA_RUNTIME_LOADING", False,
        "serve `POST v1/load_lora_adapter` / `v1/unload_lora_adapter` (under TorchServe: with its management key in "
        "`X-Management-Key`)")
    lora_adapter_root: str = setting(
        "LORA_ADAPTER_ROOT", "",
        "the only folder runtime loads may read (paths resolved with symlinks; required with `LORA_RUNTIME_LOADING`)",
        parse=str.strip)

    @property
    def lora_enabled(self) -> bool:
        return bool(self.lora_adapters) or self.lora_runtime_loading

    def with_lora_base(self, folder: str) -> "Settings":
        """LORA_ADAPTERS' relative paths read below ``folder`` (TorchServe: the archive's extracted folder,
        where ``torch-model-archiver --extra-files`` puts packaged adapters)."""
        from dataclasses import replace

        return replace(self, lora_adapters=tuple((name, path if os.path.isabs(path) else os.path.join(folder, path))
                                                 for name, path in self.lora_adapters))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, flags: Mapping[str, str] | None = None) -> "Settings":
        """The settings of ``env`` (the process's environment when None); ``flags``: values given as
        ``llm_api serve`` options, by variable name, read over the environment's (``Setting.flag``)."""
        env = os.environ if env is None else env
        if flags:
            env = {**env, **flags}
        values: dict[str, Any] = {}
        for name, declared in declared_settings().items():
            values[name] = declared.read(env, values)
        values["dtype_from_env"] = bool(env.get("DTYPE", "").strip())
        # Checks across settings.
        if values["lora_runtime_loading"] and not values["lora_adapter_root"]:
            raise ConfigError("LORA_RUNTIME_LOADING=true needs LORA_ADAPTER_ROOT: the folder runtime loads may read "
                              "adapters from")
        if values["lora_adapter_root"] and not Path(values["lora_adapter_root"]).is_dir():
            raise ConfigError(f"LORA_ADAPTER_ROOT={values['lora_adapter_root']!r} is not a folder")
        if (values["lora_adapters"] or values["lora_runtime_loading"]) and values["engine"] != "paged":
            raise ConfigError("LoRA adapters (LORA_ADAPTERS, LORA_RUNTIME_LOADING) need ENGINE=paged")
        if 0 < values["max_num_batched_tokens"] < values["max_num_seqs"]:
            # The scheduler serves running requests first: a smaller budget would starve the newest.
            raise ConfigError(f"MAX_NUM_BATCHED_TOKENS={values['max_num_batched_tokens']} is below MAX_NUM_SEQS="
                              f"{values['max_num_seqs']}; allowed values: 0 (sized to the device) or >= MAX_NUM_SEQS")
        tls_error = _tls_pairing(values)
        if tls_error:
            raise ConfigError(tls_error)
        if values["ngram_min"] > values["ngram_max"]:
            raise ConfigError(f"NGRAM_MIN={values['ngram_min']} is above NGRAM_MAX={values['ngram_max']}; allowed "
                              "values: 1 <= NGRAM_MIN <= NGRAM_MAX")
        return cls(**values)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name of the base model: MODEL_NAME first, then SERVED_MODEL_NAME's."""
        return (self.model_name, *self.served_model_names)

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys of LLM_API_KEY (empty when unset): any one of them is accepted, each its own owner of
        stored responses."""
        return split_api_keys(self.api_key)

    @property
    def api_key_priorities(self) -> dict[str, int]:
        """The keys given ``priority=N`` in LLM_API_KEY (``keyB priority=-10``), with N: how far that key's
        priorities count against other keys' requests (the fair-share scheduler's rank,
        llm_api.engine.scheduler). Every other key's requests rank 0 against other keys whatever priority they
        send (their priority orders only their own); N < 0 lets the key's requests of priority below 0 go
        ahead of other keys' (down to N); N > 0 puts all of the key's requests behind other keys' (a batch
        key)."""
        return api_key_priorities(self.api_key)


def _tls_pairing(values: Mapping[str, Any]) -> str:
    """Why the TLS settings cannot be served together ("" when they can): a key is nothing without its
    certificate and the reverse, and a client CA asks for certificates over a TLS the server does not speak
    without them."""
    key, cert, ca = values["ssl_keyfile"], values["ssl_certfile"], values["ssl_ca_certs"]
    if bool(key) != bool(cert):
        given, missing = ("SSL_KEYFILE (--ssl-keyfile)", "SSL_CERTFILE (--ssl-certfile)") if key else \
            ("SSL_CERTFILE (--ssl-certfile)", "SSL_KEYFILE (--ssl-keyfile)")
        return f"{given} is set but {missing} is not: TLS needs the private key and its certificate together"
    if ca and not key:
        return ("SSL_CA_CERTS (--ssl-ca-certs) asks clients for certificates, which needs TLS: set SSL_KEYFILE and "
                "SSL_CERTFILE too")
    return ""


# Fields of Settings that no variable sets: from_env computes them from the settings.
DERIVED_FIELDS = ("dtype_from_env",)


def declared_settings() -> dict[str, Setting]:
    """Each setting's declaration by its ``Settings`` field name, in declaration order."""
    return {f.name: f.metadata["setting"] for f in fields(Settings) if "setting" in f.metadata}


README_HEADER = ("| variable | default | values |", "|---|---|---|")


def readme_table() -> str:
    """The README's table of variables, one row per setting (a ``joins_previous`` one in its predecessor's row).
    A ``|`` inside a cell is escaped: GitHub splits cells there even inside backticks."""
    rows: list[tuple[list[str], list[str], str]] = []
    for declared in declared_settings().values():
        name, default = f"`{declared.env}`", declared.readme_default()
        if declared.flag:
            name += f" (`{declared.flag}`)"
        if declared.joins_previous:
            rows[-1][0].append(name)
            rows[-1][1].append(default)
        else:
            rows.append(([name], [default], declared.doc))
    lines = list(README_HEADER)
    for names, defaults, doc in rows:
        cells = (", ".join(names), ", ".join(defaults), doc)
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def parse_device_map(value: str) -> str | int | dict:
    """Turn a validated DEVICE_MAP string into what ``from_pretrained(device_map=...)`` takes."""
    if value.isdigit():
        return int(value)
    if value.startswith("{"):
        return json.loads(value)
    return value
