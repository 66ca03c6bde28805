"""What ``scripts/build_llamacpp.sh`` built, for the scripts that run llama.cpp beside llm_api
(bench/peer_llamacpp.py, bench/perplexity.py, bench/server_memory.py).

``build_info(folder)``: ``.cache/llamacpp/build-info.txt`` as a dict (the llama.cpp commit, the binaries, the
GGUF files, the checkpoints); a missing file stops the script with what to run. ``FORMATS``: the GGUF files
a script's ``--formats`` names, by that name, with the build-info key that holds each file's path;
``gguf_path(info, name)`` is that path (a float type, ``f32`` or ``bf16``, too), or a stop that says which
build step makes it. ``describe_gguf(path)``: the path, its size and how many tensors of each type it holds
(``tensor_types``: read with the ``gguf`` package, imported when called), what a report records so that a
quantized file's fallbacks are seen (Q4_K_M of a model 576 wide keeps the rows that are not a multiple of
256 long in Q5_0 / Q8_0). ``LlamaServer``: ``llama-server`` on a free loopback port, in its own process
group, stopped by its pid.

    python -m harness.llamacpp FILE.gguf...     (from bench/): {file name: {type: count}} as JSON

(scripts/build_llamacpp.sh records its files' tensor types with it.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .server_process import REPO, free_ports

LLAMACPP_DIR = REPO / ".cache" / "llamacpp"
# --formats name -> the build-info key of its GGUF file (build_llamacpp.sh writes these keys)
FORMATS = {"q4_1": "gguf_q4_1", "q8_0": "gguf_q8_0", "q4_k_m": "gguf_q4_k_m", "1b_q4_k_m": "gguf_1b_q4_k_m",
           "1b_q5_k_m": "gguf_1b_q5_k_m"}
FLOAT_FORMATS = {"f32": "gguf_f32", "bf16": "gguf_bf16"}


def build_info(folder: str | os.PathLike[str] = LLAMACPP_DIR) -> dict[str, str]:
    path = Path(folder) / "build-info.txt"
    if not path.is_file():
        raise SystemExit(f"no {path}: run scripts/build_llamacpp.sh first")
    lines = (line for line in path.read_text().splitlines() if "=" in line and not line.startswith("#"))
    return dict(line.split("=", 1) for line in lines)


def gguf_path(info: dict[str, str], name: str) -> str:
    """The GGUF file of ``name`` (a ``FORMATS`` or ``FLOAT_FORMATS`` name) that the build recorded."""
    key = {**FORMATS, **FLOAT_FORMATS}[name]
    path = info.get(key)
    if not path:
        step = "BUILD_1B=1 scripts/build_llamacpp.sh" if name.startswith("1b") else "scripts/build_llamacpp.sh"
        raise SystemExit(f"build-info.txt has no {key} (the {name} GGUF file): run {step}")
    if not Path(path).is_file():
        raise SystemExit(f"{key}={path} is not there: run scripts/build_llamacpp.sh again")
    return path


def tensor_types(path: str | os.PathLike[str]) -> dict[str, int]:
    """How many tensors of each type (F32, Q4_K, ...) the GGUF file holds, most frequent first."""
    import gguf

    counts = Counter(tensor.tensor_type.name for tensor in gguf.GGUFReader(path).tensors)
    return dict(counts.most_common())


def describe_gguf(path: str | os.PathLike[str]) -> dict[str, Any]:
    return {"path": str(path), "bytes": Path(path).stat().st_size, "tensor_types": tensor_types(path)}


def gguf_metadata(path: str | os.PathLike[str], *keys: str) -> dict[str, Any]:
    """The values of ``keys`` (``tokenizer.ggml.add_bos_token``, ...) in the file's header; absent ones left out."""
    import gguf

    fields = gguf.GGUFReader(path).fields
    return {key: fields[key].contents() for key in keys if key in fields}


class LlamaServer:
    """``llama-server -m GGUF`` on a free loopback port with ``threads`` threads and ``extra`` options, in its
    own process group (stopped by its pid); its output goes to ``workdir/llama-server.log``."""

    def __init__(self, binary: str, gguf: str, workdir: Path, *, threads: int, extra: Sequence[str] = ()):
        self.port = free_ports(1)[0]
        self.cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
                    "-tb", str(threads), *extra]
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base(self) -> str:
        return f"{self.http}/v1"

    def key(self) -> str:
        return "none"

    def start(self, timeout: float = 120) -> "LlamaServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "llama-server.log", "wb") as log:  # (the child holds its own copy)
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.http}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"llama-server not ready after {timeout} s: {self.log_tail()}")

    def post(self, route: str, body: dict, timeout: float = 600) -> Any:
        request = urllib.request.Request(f"{self.http}{route}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return json.loads(resp.read())

    def log_tail(self) -> str:
        return (self.workdir / "llama-server.log").read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def main(argv: list[str]) -> int:
    print(json.dumps({Path(path).name: tensor_types(path) for path in argv}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
