"""Settings, built once from the environment.

This is the only module that reads ``os.environ``. ``Settings.from_env`` validates every variable and
raises ``ConfigError`` naming the variable and its allowed values, so a bad value stops the model from
loading with a message a user can act on. Tests build settings from a plain dict.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

DTYPES = ("bfloat16", "float16", "float32", "auto")
QUANTIZATIONS = ("none", "8bit", "4bit")
BNB_4BIT_QUANT_TYPES = ("nf4", "fp4")
CPU_PACKED_WEIGHTS_MODES = ("auto", "true", "false")  # llm_api.model.packed_linear
ENGINES = ("paged", "generate")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
REASONING_PARSERS = ("none", "auto", "deepseek_r1", "qwen3")  # llm_api.api.reasoning
DEFAULT_MODEL_DIR_NAME = "SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """A setting has a value the server cannot run with."""


def default_cache_dir(env: Mapping[str, str]) -> Path:
    """Where prepared models and measured step budgets live (outside git): $LLM_API_CACHE, else ~/.cache/llm_api."""
    if env.get("LLM_API_CACHE"):
        return Path(env["LLM_API_CACHE"])
    return Path(env.get("HOME", str(Path.home()))) / ".cache" / "llm_api"


def default_model_path(env: Mapping[str, str]) -> Path:
    return default_cache_dir(env) / "models" / DEFAULT_MODEL_DIR_NAME


@dataclass(frozen=True)
class Settings:
    model_name: str = "smollm2"
    model_path: str = ""  # empty: the embedded default model in the cache dir
    cache_dir: str = ""  # LLM_API_CACHE, else ~/.cache/llm_api: prepared models, measured CPU step budgets
    device_map: str = "auto"  # auto | cpu | cuda | cuda:N | an integer | a JSON object
    max_input_tokens: int = 2048
    max_new_tokens: int = 2048
    dtype: str = "bfloat16"
    dtype_from_env: bool = False  # DTYPE was set: always honoured (else a CPU may run float32, see loader)
    quantization: str = "none"
    bnb_4bit_quant_type: str = "nf4"  # the 4-bit data type of QUANTIZATION=4bit
    # CPU only: linear weights reordered once at load into oneDNN's blocked layout (llm_api.model.packed_linear);
    # auto: bfloat16 models, and float32 ones on AMD CPUs (where it was measured to win), true: float32 too.
    cpu_packed_weights: str = "auto"
    offload_folder: str = ""  # where DEVICE_MAP "disk" entries put weights; empty: <cache dir>/offload/<model>
    end_of_stream_token: str = "<|endoftext|>"
    # How a reasoning model's <think> block is split from its answer (llm_api.api.reasoning); auto: from
    # the chat template (none when it has no think tags).
    reasoning_parser: str = "auto"
    # tool_choice auto on a chat template without a tool format (the generic form, llm_api.api.tools);
    # false: refused as vLLM refuses auto without a tool parser.
    generic_tool_choice_auto: bool = True
    # Generation path: the paged engine, or transformers' generate() (the reference).
    engine: str = "paged"
    # Paged KV cache and scheduler limits.
    kv_block_size: int = 16
    kv_cache_memory_mib: int = 0  # 0: sized automatically (GPU: free memory x utilization)
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 0  # tokens per engine step; 0: sized to the device (2048 on CUDA, probed on CPU)
    # GPU fast path: attention kernels (auto: Triton on CUDA when importable, else torch) and the
    # CUDA-graph-captured decode step for batch sizes up to the maximum (then eager).
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    fused_kernels: bool = True
    cuda_graph_max_batch_size: int = 128
    # Speculative decoding by n-gram prompt lookup (llm_api.engine.speculative): draft tokens per step
    # (0: off), the n-gram sizes looked up (longest first) and the largest decoding batch that drafts.
    speculative_tokens: int = 0
    ngram_min: int = 1
    ngram_max: int = 4
    speculative_max_batch: int = 8
    request_timeout_s: float = 600.0
    # TorchServe only: stream gRPC answers when a request asks ("stream": "true"). TorchServe's backend
    # cannot tell a unary Predictions call from StreamPredictions, and a second message to a unary call
    # kills the worker, so this is off unless every gRPC client is trusted (docs/reliability.md).
    grpc_streaming: bool = False
    # Backpressure (async mode): requests beyond these get 503 at once instead of queueing unbounded.
    max_waiting_requests: int = 256  # accepted but not yet running, on top of MAX_NUM_SEQS
    max_tokens_in_flight: int = 1_048_576  # sum over live requests of prompt + max_new_tokens
    # One request's work (llm_api.api.request.request_work): prompt tokens + n x max_new_tokens x (1 + logprob
    # entries per token). The other caps bound each factor alone; this bounds their product (400 above it).
    max_request_work: int = 262_144
    # The standalone server (llm_api serve). Its bearer keys: LLM_API_KEY (comma-separated, see api_keys), or
    # one generated per start.
    api_key: str = field(default="", repr=False)
    drain_grace_s: float = 30.0  # after SIGTERM: how long in-flight requests may take to finish
    max_request_bytes: int = 6_553_500  # largest request body (TorchServe's max_request_size default)
    # The standalone server's transport limits (llm_api.server.transport says how each is enforced).
    keepalive_timeout_s: float = 15.0  # a connection's deadline for a complete request head, when idle too
    body_timeout_s: float = 60.0  # a request's deadline for its whole body, from its head
    write_timeout_s: float = 30.0  # a deadline for each write of an answer (a client that stopped reading)
    send_buffer_bytes: int = 262_144  # the kernel's send buffer per connection (SO_SNDBUF); 0: the kernel's own
    max_connections: int = 512  # open connections served at once; those beyond get 503 and are closed
    # Connections that no authenticated request has used yet (llm_api.server.connections): their own budget,
    # a cap per client address, and a deadline to start a request.
    max_untrusted_connections: int = 64
    max_connections_per_client: int = 128
    header_timeout_s: float = 5.0
    # Stored responses (the Responses API's store: true; llm_api.service.response_store): oldest evicted
    # first past either bound, each gone after the TTL; an empty path keeps them in memory only.
    responses_store_max_entries: int = 10_000  # 0: nothing is stored
    responses_store_max_bytes: int = 64 * 1024 * 1024
    responses_store_ttl_s: float = 86_400.0
    # One owner's (key's) share of the store: its own oldest entries are evicted first past these.
    responses_store_owner_max_entries: int = 2_500
    responses_store_owner_max_bytes: int = 16 * 1024 * 1024
    responses_store_path: str = ""
    # LoRA adapters (llm_api.lora, docs/lora.md): PEFT adapter folders served beside the base model, by name.
    lora_adapters: tuple[tuple[str, str], ...] = ()  # LORA_ADAPTERS=name=path,name2=path2
    max_lora_rank: int = 64
    max_loras: int = 4  # adapters resident in one step; more are kept on the host and swapped in
    lora_runtime_loading: bool = False  # POST v1/load_lora_adapter / v1/unload_lora_adapter
    lora_adapter_root: str = ""  # the only folder runtime loading reads from

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
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        values: dict[str, Any] = {
            "model_name": _nonempty(env, "MODEL_NAME", cls.model_name),
            "model_path": env.get("MODEL_PATH", "") or str(default_model_path(env)),
            "cache_dir": str(default_cache_dir(env)),
            "device_map": _device_map(env.get("DEVICE_MAP", cls.device_map)),
            "max_input_tokens": _int(env, "MAX_INPUT_TOKENS", cls.max_input_tokens, minimum=1),
            "max_new_tokens": _int(env, "MAX_NEW_TOKENS", cls.max_new_tokens, minimum=1),
            "dtype": _choice(env, "DTYPE", cls.dtype, DTYPES),
            "dtype_from_env": bool(env.get("DTYPE", "").strip()),
            "quantization": _choice(env, "QUANTIZATION", cls.quantization, QUANTIZATIONS),
            "bnb_4bit_quant_type": _choice(env, "BNB_4BIT_QUANT_TYPE", cls.bnb_4bit_quant_type, BNB_4BIT_QUANT_TYPES),
            "cpu_packed_weights": _choice(env, "CPU_PACKED_WEIGHTS", cls.cpu_packed_weights, CPU_PACKED_WEIGHTS_MODES),
            "offload_folder": env.get("OFFLOAD_FOLDER", "")
            or str(default_cache_dir(env) / "offload" / _nonempty(env, "MODEL_NAME", cls.model_name)),
            "end_of_stream_token": _marker(env.get("END_OF_STREAM_TOKEN", cls.end_of_stream_token)),
            "reasoning_parser": _choice(env, "REASONING_PARSER", cls.reasoning_parser, REASONING_PARSERS),
            "generic_tool_choice_auto": _bool(env, "GENERIC_TOOL_CHOICE_AUTO", cls.generic_tool_choice_auto),
            "engine": _choice(env, "ENGINE", cls.engine, ENGINES),
            "kv_block_size": _int(env, "KV_BLOCK_SIZE", cls.kv_block_size, minimum=1),
            "kv_cache_memory_mib": _int(env, "KV_CACHE_MEMORY_MIB", cls.kv_cache_memory_mib, minimum=0),
            "gpu_memory_utilization": _float(
                env, "GPU_MEMORY_UTILIZATION", cls.gpu_memory_utilization, 0.0, 1.0
            ),
            "max_num_seqs": _int(env, "MAX_NUM_SEQS", cls.max_num_seqs, minimum=1),
            "max_num_batched_tokens": _int(
                env, "MAX_NUM_BATCHED_TOKENS", cls.max_num_batched_tokens, minimum=0
            ),
            "attention_backend": _choice(env, "ATTENTION_BACKEND", cls.attention_backend, ATTENTION_BACKENDS),
            "cuda_graphs": _bool(env, "CUDA_GRAPHS", cls.cuda_graphs),
            "fused_kernels": _bool(env, "FUSED_KERNELS", cls.fused_kernels),
            "cuda_graph_max_batch_size": _int(env, "CUDA_GRAPH_MAX_BATCH_SIZE", cls.cuda_graph_max_batch_size,
                                              minimum=1),
            "speculative_tokens": _int(env, "SPECULATIVE_TOKENS", cls.speculative_tokens, minimum=0),
            "ngram_min": _int(env, "NGRAM_MIN", cls.ngram_min, minimum=1),
            "ngram_max": _int(env, "NGRAM_MAX", cls.ngram_max, minimum=1),
            "speculative_max_batch": _int(env, "SPECULATIVE_MAX_BATCH", cls.speculative_max_batch, minimum=0),
            "request_timeout_s": _float(env, "REQUEST_TIMEOUT_S", cls.request_timeout_s, 0.0, None),
            "grpc_streaming": _bool(env, "GRPC_STREAMING", cls.grpc_streaming),
            "max_waiting_requests": _int(env, "MAX_WAITING_REQUESTS", cls.max_waiting_requests, minimum=0),
            "max_tokens_in_flight": _int(env, "MAX_TOKENS_IN_FLIGHT", cls.max_tokens_in_flight, minimum=1),
            "max_request_work": _int(env, "MAX_REQUEST_WORK", cls.max_request_work, minimum=1),
            "api_key": _api_key(env.get("LLM_API_KEY", "")),
            "drain_grace_s": _float(env, "DRAIN_GRACE_S", cls.drain_grace_s, 0.0, None),
            "max_request_bytes": _int(env, "MAX_REQUEST_BYTES", cls.max_request_bytes, minimum=1024),
            "keepalive_timeout_s": _float(env, "KEEPALIVE_TIMEOUT_S", cls.keepalive_timeout_s, 0.0, None),
            "body_timeout_s": _float(env, "BODY_TIMEOUT_S", cls.body_timeout_s, 0.0, None),
            "write_timeout_s": _float(env, "WRITE_TIMEOUT_S", cls.write_timeout_s, 0.0, None),
            "send_buffer_bytes": _int(env, "SEND_BUFFER_BYTES", cls.send_buffer_bytes, minimum=0),
            "max_connections": _int(env, "MAX_CONNECTIONS", cls.max_connections, minimum=1),
            "max_untrusted_connections": _int(env, "MAX_UNTRUSTED_CONNECTIONS", cls.max_untrusted_connections,
                                              minimum=1),
            "max_connections_per_client": _int(env, "MAX_CONNECTIONS_PER_CLIENT", cls.max_connections_per_client,
                                               minimum=1),
            "header_timeout_s": _float(env, "HEADER_TIMEOUT_S", cls.header_timeout_s, 0.0, None),
            "responses_store_max_entries": _int(env, "RESPONSES_STORE_MAX_ENTRIES", cls.responses_store_max_entries,
                                                minimum=0),
            "responses_store_max_bytes": _int(env, "RESPONSES_STORE_MAX_BYTES", cls.responses_store_max_bytes,
                                              minimum=MIN_RESPONSES_STORE_BYTES),
            "responses_store_ttl_s": _float(env, "RESPONSES_STORE_TTL_S", cls.responses_store_ttl_s, 0.0, None),
            "responses_store_owner_max_entries": _int(env, "RESPONSES_STORE_OWNER_MAX_ENTRIES",
                                                      cls.responses_store_owner_max_entries, minimum=1),
            "responses_store_owner_max_bytes": _int(env, "RESPONSES_STORE_OWNER_MAX_BYTES",
                                                    cls.responses_store_owner_max_bytes,
                                                    minimum=MIN_RESPONSES_STORE_BYTES),
            "responses_store_path": _store_path(env.get("RESPONSES_STORE_PATH", "")),
            "lora_adapters": _lora_adapters(env.get("LORA_ADAPTERS", "")),
            "max_lora_rank": _int(env, "MAX_LORA_RANK", cls.max_lora_rank, minimum=1),
            "max_loras": _int(env, "MAX_LORAS", cls.max_loras, minimum=1),
            "lora_runtime_loading": _bool(env, "LORA_RUNTIME_LOADING", cls.lora_runtime_loading),
            "lora_adapter_root": env.get("LORA_ADAPTER_ROOT", "").strip(),
        }
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
        if values["ngram_min"] > values["ngram_max"]:
            raise ConfigError(f"NGRAM_MIN={values['ngram_min']} is above NGRAM_MAX={values['ngram_max']}; allowed "
                              "values: 1 <= NGRAM_MIN <= NGRAM_MAX")
        return cls(**values)

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys of LLM_API_KEY (empty when unset): any one of them is accepted, each its own owner of
        stored responses."""
        return split_api_keys(self.api_key)


def _nonempty(env: Mapping[str, str], name: str, default: str) -> str:
    value = env.get(name, default)
    if not value.strip():
        raise ConfigError(f"{name} must not be empty")
    return value


def _marker(raw: str) -> str:
    """END_OF_STREAM_TOKEN: at least 2 characters, starting with one that can only occur inside a JSON
    string of an error object (so an error can always be written without the marker in it, see
    llm_api.api.errors.hide_marker), and without line breaks."""
    allowed = "at least 2 characters, no line breaks, not starting with a space, digit, '-' or one of {}[]\":,\\"
    if len(raw) < 2 or raw[0] in ' \t{}[]":,\\-0123456789' or any(c in raw for c in "\r\n"):
        raise ConfigError(f"END_OF_STREAM_TOKEN={raw!r} is not supported; allowed values: {allowed}")
    return raw


MIN_API_KEY_CHARS = 8


def split_api_keys(raw: str) -> tuple[str, ...]:
    """LLM_API_KEY's keys: comma-separated (vLLM's ``--api-key`` also takes several), so no key holds a comma."""
    return tuple(raw.split(",")) if raw else ()


def _api_key(raw: str) -> str:
    """LLM_API_KEY: empty (a key is generated at start), or one or more comma-separated keys, each what a
    client sends after ``Bearer ``: visible ASCII without spaces (it travels in a header), long enough not to
    be guessed in a few tries, and no key twice (two names for one owner would be a mistake). The message
    names the key by its position and length, never by its value."""
    if raw == "":
        return raw
    allowed = (f"one or more keys separated by commas, each at least {MIN_API_KEY_CHARS} visible ASCII characters "
               "without spaces or commas, or unset to generate one")
    keys = split_api_keys(raw)
    for position, key in enumerate(keys, start=1):
        if len(key) < MIN_API_KEY_CHARS or not all("!" <= c <= "~" for c in key):
            where = f"key {position} of {len(keys)}" if len(keys) > 1 else "the key"
            raise ConfigError(f"LLM_API_KEY is not usable ({where} has {len(key)} characters); allowed values: "
                              f"{allowed}")
    if len(set(keys)) != len(keys):
        raise ConfigError(f"LLM_API_KEY is not usable (a key is listed twice); allowed values: {allowed}")
    return raw


# A byte bound below one small entry would refuse every response; 1 KiB is still tiny.
MIN_RESPONSES_STORE_BYTES = 1024


def _store_path(raw: str) -> str:
    """RESPONSES_STORE_PATH: empty (memory), or an SQLite file. Whether it opens is checked when the store is
    opened (llm_api.service.response_store.open_response_store), which names this variable too."""
    if raw and (raw != raw.strip() or "\0" in raw):
        raise ConfigError(f"RESPONSES_STORE_PATH={raw!r} is not supported; allowed values: empty (memory) or a "
                          "file path without leading or trailing spaces")
    return raw


def _lora_adapters(raw: str) -> tuple[tuple[str, str], ...]:
    """LORA_ADAPTERS: ``name=path,...``; names as llm_api.lora.config.ADAPTER_NAME allows (checked there too,
    where the adapters are read)."""
    pairs: list[tuple[str, str]] = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not path or not _ADAPTER_NAME.fullmatch(name):
            raise ConfigError(f"LORA_ADAPTERS entry {item!r} is not supported; allowed values: name=path pairs "
                              f"separated by commas, names of 1-64 characters A-Z a-z 0-9 . _ - (a letter or digit first)")
        if any(name == n for n, _ in pairs):
            raise ConfigError(f"LORA_ADAPTERS names adapter {name!r} twice")
        pairs.append((name, path))
    return tuple(pairs)


_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _choice(env: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
    raw = env.get(name, default)
    value = raw.strip().lower()
    if name == "QUANTIZATION" and value in ("", "none", "null", "no", "off"):
        value = "none"
    if value not in allowed:
        shown = ", ".join("None" if a == "none" else a for a in allowed)
        raise ConfigError(f"{name}={raw!r} is not supported; allowed values: {shown}")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; allowed values: true, false, 1, 0, yes, no, on, off")


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; allowed values: integers >= {minimum}") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} is out of range; allowed values: integers >= {minimum}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, low: float, high: float | None) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    allowed = f"numbers in ({low}, {high}]" if high is not None else f"numbers > {low}"
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number; allowed values: {allowed}") from None
    if not value > low or (high is not None and value > high) or value != value:
        raise ConfigError(f"{name}={raw!r} is out of range; allowed values: {allowed}")
    return value


def _device_map(raw: str) -> str:
    """Validate DEVICE_MAP as accelerate understands it; keep the raw string (parsed at load)."""
    value = raw.strip()
    allowed = "auto, cpu, cuda, cuda:N, mps, an integer GPU index, or a JSON object of module -> device"
    if value in ("auto", "cpu", "cuda", "mps", "balanced", "sequential") or value.isdigit():
        return value
    if value.startswith("cuda:") and value[5:].isdigit():
        return value
    if value.startswith("{"):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            raise ConfigError(f"DEVICE_MAP={raw!r} is not valid JSON; allowed values: {allowed}") from None
        if isinstance(parsed, dict) and parsed:
            bad = {k: d for k, d in parsed.items() if not _is_device(d)}
            if bad:
                raise ConfigError(f"DEVICE_MAP={raw!r} maps modules to unknown devices {bad}; a module's device "
                                  f"is cpu, disk, cuda, cuda:N, mps or a GPU index")
            return value
    raise ConfigError(f"DEVICE_MAP={raw!r} is not supported; allowed values: {allowed}")


def _is_device(device) -> bool:
    """One value of a JSON device map, as accelerate takes it ("disk": offloaded to OFFLOAD_FOLDER)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device >= 0
    if not isinstance(device, str):
        return False
    return device in ("cpu", "disk", "cuda", "mps") or (device.startswith("cuda:") and device[5:].isdigit())


def parse_device_map(value: str) -> str | int | dict:
    """Turn a validated DEVICE_MAP string into what ``from_pretrained(device_map=...)`` takes."""
    if value.isdigit():
        return int(value)
    if value.startswith("{"):
        return json.loads(value)
    return value


def main() -> int:
    """``python -m llm_api.model.settings``: check the environment's settings before a server starts, so
    a bad value stops ``make serve`` with its message instead of a worker that fails to load forever."""
    import sys

    try:
        settings = Settings.from_env()
        if settings.quantization != "none":
            try:
                import bitsandbytes  # noqa: F401
            except ImportError:
                raise ConfigError(f"QUANTIZATION={settings.quantization} needs bitsandbytes: "
                                  f"pip install 'llm_api[quant]' (make serve installs it when QUANTIZATION is set)") \
                    from None
        if not (Path(settings.model_path) / "config.json").is_file():
            raise ConfigError(f"MODEL_PATH={settings.model_path!r} is not a Hugging Face checkpoint folder "
                              f"(no config.json)")
    except ConfigError as err:
        print(f"llm_api: {err}", file=sys.stderr)
        return 2
    print(f"llm_api: settings OK (model {settings.model_name} from {settings.model_path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
