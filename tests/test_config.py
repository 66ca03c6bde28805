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


@pytest.mark.parametrize(
    "name, value, needle",
    [
        ("DTYPE", "float8", "allowed values: bfloat16, float16, float32, auto"),
        ("QUANTIZATION", "3bit", "allowed values: None, 8bit, 4bit"),
        ("MAX_INPUT_TOKENS", "many", "allowed values: integers >= 1"),
        ("MAX_NEW_TOKENS", "0", "allowed values: integers >= 1"),
        ("DEVICE_MAP", "gpu-please", "allowed values: auto, cpu, cuda, cuda:N"),
        ("DEVICE_MAP", "{not json", "is not valid JSON"),
        ("END_OF_STREAM_TOKEN", "  ", "must not be empty"),
        ("ENGINE", "fast", "allowed values: paged, generate"),
        ("GPU_MEMORY_UTILIZATION", "1.5", "allowed values"),
        ("ATTENTION_BACKEND", "flash", "allowed values: auto, torch, triton"),
        ("CUDA_GRAPHS", "maybe", "allowed values: true, false"),
        ("CUDA_GRAPH_MAX_BATCH_SIZE", "0", "allowed values: integers >= 1"),
    ],
)
def test_bad_values_name_the_variable(name, value, needle):
    with pytest.raises(ConfigError) as err:
        Settings.from_env({name: value})
    assert name in str(err.value) and needle in str(err.value)


def test_device_map_forms():
    assert parse_device_map("auto") == "auto"
    assert parse_device_map("1") == 1
    assert parse_device_map('{"model.embed_tokens": "cpu", "lm_head": 0}') == {"model.embed_tokens": "cpu", "lm_head": 0}
