"""Settings from the environment: defaults users know, and bad values named with allowed ones."""

import pytest

from llm_api.model.settings import ConfigError, Settings, default_model_path, parse_device_map


def test_defaults():
    s = Settings.from_env({"HOME": "/home/u"})
    assert (s.model_name, s.device_map, s.max_input_tokens, s.max_new_tokens) == ("smollm2", "auto", 2048, 2048)
    assert (s.dtype, s.quantization, s.end_of_stream_token) == ("bfloat16", "none", "<|endoftext|>")
    assert s.model_path == str(default_model_path({"HOME": "/home/u"}))


def test_values_are_read():
    s = Settings.from_env(
        {"MODEL_NAME": "m", "MODEL_PATH": "/x", "DEVICE_MAP": "cuda:1", "MAX_INPUT_TOKENS": "10",
         "MAX_NEW_TOKENS": "5", "DTYPE": "Float32", "QUANTIZATION": "None", "END_OF_STREAM_TOKEN": "</s>"}
    )
    assert (s.model_name, s.model_path, s.device_map, s.max_input_tokens, s.max_new_tokens) == ("m", "/x", "cuda:1", 10, 5)
    assert (s.dtype, s.quantization, s.end_of_stream_token) == ("float32", "none", "</s>")
    assert Settings.from_env({"QUANTIZATION": "4bit"}).quantization == "4bit"


def test_speculative_settings_reach_the_engine_config():
    from llm_api.engine.engine import EngineConfig

    off = EngineConfig.from_settings(Settings.from_env({}))
    assert (off.speculative_tokens, off.ngram_min, off.ngram_max, off.speculative_max_batch) == (0, 1, 4, 8)
    on = EngineConfig.from_settings(Settings.from_env({"SPECULATIVE_TOKENS": "5", "NGRAM_MIN": "2", "NGRAM_MAX": "3",
                                                       "SPECULATIVE_MAX_BATCH": "4"}))
    assert (on.speculative_tokens, on.ngram_min, on.ngram_max, on.speculative_max_batch) == (5, 2, 3, 4)


@pytest.mark.parametrize(
    "name, value, needle",
    [
        ("DTYPE", "float8", "allowed values: bfloat16, float16, float32, auto"),
        ("QUANTIZATION", "3bit", "allowed values: None, q8_0, q4_0, q4_k, 8bit, 4bit"),
        ("MAX_INPUT_TOKENS", "many", "allowed values: integers >= 1"),
        ("MAX_NEW_TOKENS", "0", "allowed values: integers >= 1"),
        ("DEVICE_MAP", "gpu-please", "allowed values: auto, cpu, cuda, cuda:N"),
        ("DEVICE_MAP", "{not json", "is not valid JSON"),
        ("END_OF_STREAM_TOKEN", "  ", "not starting with a space"),
        ("END_OF_STREAM_TOKEN", "}", "at least 2 characters"),
        ("END_OF_STREAM_TOKEN", '"done"', "not starting with"),
        ("END_OF_STREAM_TOKEN", "<end>\n", "no line breaks"),
        ("MAX_NUM_BATCHED_TOKENS", "8", "below MAX_NUM_SEQS=64"),
        ("GRPC_STREAMING", "sometimes", "allowed values: true, false"),
        ("GENERIC_TOOL_CHOICE_AUTO", "maybe", "allowed values: true, false"),
        ("ENGINE", "fast", "allowed values: paged, generate"),
        ("GPU_MEMORY_UTILIZATION", "1.5", "allowed values"),
        ("ATTENTION_BACKEND", "flash", "allowed values: auto, torch, triton"),
        ("CUDA_GRAPHS", "maybe", "allowed values: true, false"),
        ("CUDA_GRAPH_MAX_BATCH_SIZE", "0", "allowed values: integers >= 1"),
        ("DRAIN_GRACE_S", "0", "allowed values: numbers > 0"),
        ("MAX_REQUEST_BYTES", "100", "allowed values: integers >= 1024"),
        ("MAX_REQUEST_WORK", "0", "allowed values: integers >= 1"),
        ("MAX_REQUEST_WORK", "2.5e5", "is not an integer"),
        ("MAX_REQUEST_WORK", "-1", "allowed values: integers >= 1"),
        ("KEEPALIVE_TIMEOUT_S", "0", "allowed values: numbers > 0"),
        ("BODY_TIMEOUT_S", "-1", "allowed values: numbers > 0"),
        ("WRITE_TIMEOUT_S", "soon", "is not a number"),
        ("SEND_BUFFER_BYTES", "-1", "allowed values: integers >= 0"),
        ("MAX_CONNECTIONS", "0", "allowed values: integers >= 1"),
        ("SPECULATIVE_TOKENS", "-1", "allowed values: integers >= 0"),
        ("NGRAM_MIN", "0", "allowed values: integers >= 1"),
        ("NGRAM_MAX", "two", "is not an integer"),
        ("NGRAM_MIN", "5", "NGRAM_MIN=5 is above NGRAM_MAX=4"),
        ("SPECULATIVE_MAX_BATCH", "-2", "allowed values: integers >= 0"),
        ("LLM_API_KEY", "abc", "at least 8 visible ASCII characters"),
        ("LLM_API_KEY", "tab\there-key", "without spaces"),
        ("SERVED_MODEL_NAME", "good bad\x00name", "allowed values: names of 1-128 characters"),
        ("SERVED_MODEL_NAME", "-leading", "a letter or digit first"),
        ("SERVED_MODEL_NAME", "a,b a", "lists a name twice"),
        ("SERVED_MODEL_NAME", "smollm2", "MODEL_NAME is always served"),
    ],
)
def test_bad_values_name_the_variable(name, value, needle):
    with pytest.raises(ConfigError) as err:
        Settings.from_env({name: value})
    assert name in str(err.value) and needle in str(err.value)


def test_served_model_names_are_aliases_after_model_name():
    settings = Settings.from_env({"MODEL_NAME": "m", "SERVED_MODEL_NAME": " gpt-4o-mini, org/model:latest  qwen3:8b "})
    assert settings.model_names == ("m", "gpt-4o-mini", "org/model:latest", "qwen3:8b")
    assert Settings.from_env({}).model_names == ("smollm2",)


def test_device_map_forms():
    assert parse_device_map("auto") == "auto"
    assert parse_device_map("1") == 1
    assert parse_device_map('{"model.embed_tokens": "cpu", "lm_head": 0}') == {"model.embed_tokens": "cpu", "lm_head": 0}


def test_dtype_default_and_the_token_budget():
    s = Settings.from_env({})
    assert s.dtype == "bfloat16" and not s.dtype_from_env and s.max_num_batched_tokens == 0 and not s.grpc_streaming
    assert Settings.from_env({"DTYPE": "bfloat16"}).dtype_from_env
    assert Settings.from_env({"MAX_NUM_BATCHED_TOKENS": "64"}).max_num_batched_tokens == 64


def test_request_work_limit():
    assert Settings.from_env({}).max_request_work == 262_144
    assert Settings.from_env({"MAX_REQUEST_WORK": " 50000 "}).max_request_work == 50_000


def test_settings_check_command(tmp_path, capsys, monkeypatch):
    from llm_api.model import preflight

    monkeypatch.setattr("os.environ", {"DTYPE": "float8"})
    assert preflight.main() == 2 and "DTYPE='float8' is not supported" in capsys.readouterr().err
    monkeypatch.setattr("os.environ", {"MODEL_PATH": str(tmp_path)})
    assert preflight.main() == 2 and "no config.json" in capsys.readouterr().err
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    assert preflight.main() == 2 and "junk.gguf: " in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "junk.gguf").unlink()
    monkeypatch.setattr("os.environ", {"MODEL_PATH": str(tmp_path), "QUANTIZATION": "8bit"})
    assert preflight.main() == 0 and "settings OK" in capsys.readouterr().out


def test_the_api_key_is_never_shown():
    secret = "s3cret-key-value"
    s = Settings.from_env({"LLM_API_KEY": secret})
    assert s.api_key == secret and secret not in repr(s)
    with pytest.raises(ConfigError) as err:
        Settings.from_env({"LLM_API_KEY": "bad key " + secret})
    assert secret not in str(err.value)


# /proc/cpuinfo texts of the CPU kinds CI and users run on (flags cut to the ones that matter and a few around).
CPUINFO = {
    "epyc-avx512-bf16": "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n"
                        "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 vaes\n\n"
                        "processor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 vaes\n",
    "epyc-avx2": "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n",
    "xeon-avx512-no-bf16": "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: avx2 avx512f avx512bw avx512_vnni\n",
    "xeon-amx": "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: avx2 avx512f amx_tile amx_bf16 amx_int8\n",
    "graviton3": "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm svebf16\n",
    "graviton2": "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd atomics asimddp\n",
    "no-cpuinfo": None,
}
NATIVE_BF16 = {"epyc-avx512-bf16", "xeon-amx", "graviton3"}


@pytest.mark.parametrize("kind", list(CPUINFO))
def test_unset_dtype_follows_the_cpus_bf16_instructions(kind, tmp_path, monkeypatch, caplog):
    """README, DTYPE: unset means bfloat16 on a GPU and on a CPU with bfloat16 matrix instructions, float32 on
    any other CPU (said in one log line); a DTYPE that is set is always used. The flag read is the real one,
    of a /proc/cpuinfo written for each CPU kind."""
    import torch

    from llm_api.model import cpu, loader

    path = tmp_path / "cpuinfo"
    if CPUINFO[kind] is not None:
        path.write_text(CPUINFO[kind])
    monkeypatch.setattr(cpu, "CPUINFO", path)
    unset = torch.bfloat16 if kind in NATIVE_BF16 else torch.float32
    assert cpu.has_native_bf16() == (kind in NATIVE_BF16)
    with caplog.at_level("INFO", logger="llm_api.model.loader"):
        assert loader.resolve_dtype(Settings.from_env({}), None, on_gpu=False) == unset
    assert any("using float32" in r.getMessage() for r in caplog.records) == (unset == torch.float32)
    assert loader.resolve_dtype(Settings.from_env({}), None, on_gpu=True) == torch.bfloat16
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32), ("float16", torch.float16)):
        assert loader.resolve_dtype(Settings.from_env({"DTYPE": name}), None, on_gpu=False) == dtype
    assert loader.resolve_dtype(Settings.from_env({"DTYPE": "auto"}), torch.bfloat16, on_gpu=False) == torch.bfloat16


def test_this_hosts_flags_are_read():
    """The real /proc/cpuinfo parses (on Linux) and gives the answer its flags say."""
    from llm_api.model import cpu

    if not cpu.CPUINFO.exists():
        pytest.skip("no /proc/cpuinfo")
    features = cpu.cpu_features(cpu.CPUINFO.read_text())
    assert features, "no flags line found"
    assert cpu.has_native_bf16() == bool(features & {"avx512_bf16", "amx_bf16", "bf16"})


def test_transport_limits_have_safe_defaults_and_are_read():
    s = Settings.from_env({})
    assert (s.keepalive_timeout_s, s.body_timeout_s, s.write_timeout_s, s.send_buffer_bytes, s.max_connections) == \
        (15.0, 60.0, 30.0, 262_144, 512)
    s = Settings.from_env({"KEEPALIVE_TIMEOUT_S": "2", "BODY_TIMEOUT_S": "3", "WRITE_TIMEOUT_S": "4",
                           "SEND_BUFFER_BYTES": "0", "MAX_CONNECTIONS": "8"})
    assert (s.keepalive_timeout_s, s.body_timeout_s, s.write_timeout_s, s.send_buffer_bytes, s.max_connections) == \
        (2.0, 3.0, 4.0, 0, 8)


def test_generic_tool_choice_auto_is_read():
    assert Settings.from_env({}).generic_tool_choice_auto
    assert not Settings.from_env({"GENERIC_TOOL_CHOICE_AUTO": "false"}).generic_tool_choice_auto


# ---------------------------------------------------------------------------------------------------
# Each setting declared once (llm_api.model.settings.setting): the README's table and the reading follow.

def _settings_table_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "settings_table.py"
    spec = importlib.util.spec_from_file_location("settings_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_table_is_generated_from_the_declarations():
    from llm_api.model.settings import readme_table

    script = _settings_table_script()
    readme = script.README.read_text()
    assert readme.count(script.BEGIN) == 1 and readme.count(script.END) == 1
    assert script.with_table(readme, readme_table()) == readme, \
        "README.md's settings table is stale: run python scripts/settings_table.py --write"


def test_a_changed_doc_makes_the_readme_stale():
    from llm_api.model.settings import readme_table

    script = _settings_table_script()
    readme = script.README.read_text()
    edited = readme_table().replace("tokens per KV-cache block", "tokens per block")
    assert edited != readme_table() and script.with_table(readme, edited) != readme


def test_every_field_is_one_declared_variable():
    """A field is a setting or derived; each variable is declared once; the annotation is the default's type,
    a number has its bound, a choice's default is allowed and the doc names each choice."""
    import dataclasses

    from llm_api.model.settings import DERIVED_FIELDS, declared_settings

    declared = declared_settings()
    names = [f.name for f in dataclasses.fields(Settings)]
    assert sorted(names) == sorted([*declared, *DERIVED_FIELDS])
    variables = [d.env for d in declared.values()]
    assert len(variables) == len(set(variables)), variables
    types = {f.name: f.type for f in dataclasses.fields(Settings)}
    for name, d in declared.items():
        assert types[name] == type(d.default).__name__ or d.derive is not None, name
        if isinstance(d.default, (int, float)) and not isinstance(d.default, bool):
            assert d.minimum is not None, name
        if d.choices:
            assert d.default in d.choices, name
            assert all(f"`{choice}`" in d.doc.lower() for choice in d.choices), name
        assert d.doc or d.joins_previous, name


def test_unset_variables_read_as_the_declared_defaults():
    """from_env({}) and Settings() agree on every setting not derived from several variables."""
    from llm_api.model.settings import declared_settings

    read, plain = Settings.from_env({}), Settings()
    for name, d in declared_settings().items():
        if d.derive is None:
            assert getattr(read, name) == getattr(plain, name) == d.default, name


def test_sub_configs_default_to_the_settings_defaults():
    """EngineConfig and SpeculativeConfig built directly agree with the settings' defaults, except where the
    engine's meaning differs: a fixed token budget instead of a measured one, the model's own length limit and
    no budget cache."""
    import dataclasses

    from llm_api.engine.engine import EngineConfig
    from llm_api.engine.speculative.drafter import SpeculativeConfig

    built, plain = EngineConfig.from_settings(Settings()), EngineConfig()
    differ = {f.name for f in dataclasses.fields(EngineConfig) if getattr(built, f.name) != getattr(plain, f.name)}
    assert differ == {"max_num_batched_tokens", "max_model_len", "step_budget_cache"}
    spec = SpeculativeConfig()
    assert (spec.num_tokens, spec.ngram_min, spec.ngram_max, spec.max_batch) == \
        (plain.speculative_tokens, plain.ngram_min, plain.ngram_max, plain.speculative_max_batch)


def test_settings_check_refuses_quantization_without_bitsandbytes(monkeypatch, capsys):
    """`make serve`'s check (``python -m llm_api.model.preflight``) looks bitsandbytes up (without importing it:
    that took 7-10 s) and, absent, stops with the install hint."""
    import importlib.util

    from llm_api.model import preflight as settings_module

    monkeypatch.setenv("QUANTIZATION", "8bit")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "bitsandbytes" else find_spec(name, *args))
    assert settings_module.main() == 2
    assert "QUANTIZATION=8bit needs bitsandbytes: pip install 'llm_api[quant]'" in capsys.readouterr().err
