"""The README's commands: the archiver command as written, the main job, and bad settings."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llm_api.client import HTTPClient
from bench.harness.server_process import free_ports, launch
from bench.harness.torchserve_server import TorchServe

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def test_archiver_command_as_written(tmp_path):
    (tmp_path / "llm_api" / "torchserve").mkdir(parents=True)
    shutil.copy(REPO / "llm_api" / "torchserve" / "llm_handler.py", tmp_path / "llm_api" / "torchserve")
    (tmp_path / "model-store").mkdir()
    # TMPDIR: the archiver stages in $TMPDIR/<model name> and deletes it; another build of "smollm2" at
    # the same time (a server fixture on another xdist worker) would lose its staging folder.
    env = {**os.environ, "MODEL_NAME": "smollm2", "PATH": f"{BIN}:{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
    subprocess.run(
        "torch-model-archiver --model-name $MODEL_NAME --version 1.0 --handler llm_api/torchserve/llm_handler.py "
        "--archive-format no-archive --export-path model-store",
        shell=True, check=True, cwd=tmp_path, env=env,
    )
    archive = tmp_path / "model-store" / "smollm2"
    assert (archive / "llm_handler.py").is_file() and (archive / "MAR-INF" / "MANIFEST.json").is_file()


def test_the_scripts_keep_pythons_bytecode():
    """Where PYTHONDONTWRITEBYTECODE is set (this project's CI host), what the scripts start must still write
    the bytecode of what it imports: without it every server start and test process compiled torch and
    transformers again (a server start 23 s instead of 8 s; the suite a quarter slower: scripts/env.sh)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    shown = subprocess.run(["bash", "-c", ". scripts/env.sh && python -c 'import sys; print(sys.flags.dont_write_bytecode)'"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == "0"
    for script in ("serve.sh", "serve_standalone.sh", "test.sh", "build_archive.sh"):
        assert ". scripts/env.sh" in (REPO / "scripts" / script).read_text(), script


@pytest.mark.server
def test_bad_env_value_stops_the_model_loading(tmp_path, embedded_model_path):
    server = TorchServe(tmp_path, env={"MODEL_PATH": str(embedded_model_path), "DTYPE": "float8"})
    try:
        server.start(wait_ready=False)
        deadline = time.monotonic() + 120
        while "DTYPE='float8' is not supported" not in server.model_log() and time.monotonic() < deadline:
            time.sleep(0.5)
        log = server.model_log()
        assert "DTYPE='float8' is not supported; allowed values: bfloat16, float16, float32, auto" in log
        assert server.worker_status() != "READY"
    finally:
        server.stop()


def test_main_job_stops_on_a_bad_setting_before_torchserve_starts(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "TEMP": str(tmp_path), "DTYPE": "float8"}
    done = subprocess.run(["make", "serve"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "DTYPE='float8' is not supported; allowed values" in done.stderr + done.stdout
    assert "starting TorchServe" not in done.stdout


@pytest.mark.server
# A quantized start through the main job too: QUANTIZATION reaches the handler's loader the same way whatever its
# value, so one value here (4bit: bitsandbytes, the slowest load) and each value's answer in-process
# (tests/test_model_options.py: 8bit, 4bit and the GGUF formats) cover them; 8bit here too cost ~40 s of the suite.
@pytest.mark.parametrize("quantization", [None, "4bit"])
def test_main_job_serves_the_embedded_model(tmp_path, quantization):
    """`make serve` as a user runs it (also with QUANTIZATION), ports moved by TorchServe's TS_* variables."""
    names = ("inference", "management", "metrics", "grpc", "grpc_mgmt")
    ports = dict(zip(names, free_ports(len(names))))
    env = {
        **os.environ,
        **({"QUANTIZATION": quantization} if quantization else {}),
        "TMPDIR": str(tmp_path),
        "TEMP": str(tmp_path),  # the Java frontend's temp dir (its worker socket) comes from TEMP
        "TS_INFERENCE_ADDRESS": f"http://127.0.0.1:{ports['inference']}",
        "TS_MANAGEMENT_ADDRESS": f"http://127.0.0.1:{ports['management']}",
        "TS_METRICS_ADDRESS": f"http://127.0.0.1:{ports['metrics']}",
        "TS_GRPC_INFERENCE_PORT": str(ports["grpc"]),
        "TS_GRPC_MANAGEMENT_PORT": str(ports["grpc_mgmt"]),
    }
    env.pop("TRITON_INTERPRET", None)  # (the kernel tests' setting: a user's shell has none)
    probe = TorchServe(REPO, ports=ports)  # reads REPO/key_file.json and asks the management API
    with open(tmp_path / "serve.out", "wb") as out:  # (the child holds its own copy of the file)
        # Guarded in a new session, as ServerProcess.start() does: probe.stop() then ends make and all it started.
        probe.proc = launch(["make", "serve"], cwd=REPO, env=env, out=out, pid_file=tmp_path / "make.pid")
    try:
        probe.wait_ready(timeout=300)
        text = (tmp_path / "serve.out").read_text(errors="replace")
        assert "curl -N" in text  # it says how to call it
        key = probe.key()
        answer = HTTPClient(f"http://127.0.0.1:{ports['inference']}", "smollm2", key).generate(
            {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_new_tokens": 24}
        )
        assert "Paris" in answer
    finally:
        probe.stop(grace=15)
