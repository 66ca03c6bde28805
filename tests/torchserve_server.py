"""A real TorchServe for tests and benchmarks: own ports, own TMPDIR and working directory, stopped by its pid.

``TorchServe.start()`` builds the archive (a folder, or a ``.mar``) from the repo's handler and the
given model-config, writes a config.properties that is the shipped one with free loopback ports, and
starts ``torchserve --foreground`` in a new process session. ``stop()`` signals that session (the
launcher, its Java frontend and the Python workers it forked) and nothing else.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_archive(workdir: Path, model_name: str, model_config: str | None, mar: bool = False) -> Path:
    store = workdir / "model-store"
    store.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(BIN / "torch-model-archiver"), "--model-name", model_name, "--version", "1.0",
        "--handler", str(REPO / "llm_api" / "torchserve" / "llm_handler.py"),
        "--export-path", str(store), "--force",
    ]
    if not mar:
        cmd += ["--archive-format", "no-archive"]
    if model_config is not None:
        cfg = workdir / "model-config.yaml"
        cfg.write_text(model_config)
        cmd += ["--config-file", str(cfg)]
    subprocess.run(cmd, check=True, cwd=workdir)
    return store


@dataclass
class TorchServe:
    workdir: Path
    model_name: str = "smollm2"
    model_config: str | None = None
    env: dict = field(default_factory=dict)
    mar: bool = False
    extra_properties: str = ""  # appended to the shipped config.properties (a user's own settings)
    proc: subprocess.Popen | None = None
    ports: dict = field(default_factory=dict)

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.ports['inference']}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    kind = "torchserve"  # (the front-end surface shared with tests/standalone_server.py)

    @property
    def native_url(self) -> str:
        return f"{self.http}/predictions/{self.model_name}"

    @property
    def openai_base(self) -> str:
        return f"{self.http}/predictions/{self.model_name}/1.0/v1"

    @property
    def ready_url(self) -> str:
        return f"{self.openai_base}/health"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    def key(self, kind: str = "inference") -> str:
        return json.loads((self.workdir / "key_file.json").read_text())[kind]["key"]

    def model_log(self) -> str:
        path = self.log_dir / "model_log.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for_log_lines(self, needle: str, count: int = 1, timeout: float = 10) -> list[str]:
        """The model-log lines holding ``needle`` once there are ``count`` of them: the worker's output
        reaches model_log.log through the frontend a moment after the response that follows it."""
        deadline = time.monotonic() + timeout
        while True:
            lines = [line for line in self.model_log().splitlines() if needle in line]
            if len(lines) >= count or time.monotonic() > deadline:
                return lines
            time.sleep(0.1)

    def start(self, wait_ready: bool = True, timeout: float = 240) -> "TorchServe":
        self.workdir.mkdir(parents=True, exist_ok=True)
        store = build_archive(self.workdir, self.model_name, self.model_config, self.mar)
        self.ports = {k: free_port() for k in ("inference", "management", "metrics", "grpc", "grpc_mgmt")}
        shipped = (REPO / "config.properties").read_text()
        props = re.sub(r"(?m)^(inference|management|metrics)_address=.*$", lambda m: f"{m.group(1)}_address=http://127.0.0.1:{self.ports[m.group(1)]}", shipped)
        props = re.sub(r"(?m)^grpc_inference_port=.*$", f"grpc_inference_port={self.ports['grpc']}", props)
        props = re.sub(r"(?m)^grpc_management_port=.*$", f"grpc_management_port={self.ports['grpc_mgmt']}", props)
        props = re.sub(r"(?m)^model_store=.*$", f"model_store={store}", props)
        (self.workdir / "config.properties").write_text(props + self.extra_properties)
        tmp = self.workdir / "tmp"
        tmp.mkdir(exist_ok=True)
        # TEMP too: the Java frontend takes its temp dir (and the worker socket's) from it, not TMPDIR.
        env = {**os.environ, "TMPDIR": str(tmp), "TEMP": str(tmp), "LOG_LOCATION": str(self.log_dir), "METRICS_LOCATION": str(self.log_dir), **self.env}
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        target = self.model_name + (".mar" if self.mar else "")
        self.proc = subprocess.Popen(
            [str(BIN / "torchserve"), "--start", "--foreground", "--ncs", "--ts-config", "config.properties",
             "--model-store", str(store), "--models", f"{self.model_name}={target}"],
            cwd=self.workdir, env=env, stdout=open(self.workdir / "torchserve.out", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"torchserve exited with {self.proc.returncode}:\n{self.tail()}")
            if self.worker_status() == "READY":
                return
            time.sleep(0.5)
        raise TimeoutError(f"model not ready after {timeout}s:\n{self.tail()}")

    def worker_status(self) -> str | None:
        try:
            req = urllib.request.Request(
                f"http://127.0.0.1:{self.ports['management']}/models/{self.model_name}",
                headers={"Authorization": f"Bearer {self.key('management')}"},
            )
            with urllib.request.urlopen(req, timeout=5) as resp:
                workers = json.loads(resp.read())[0]["workers"]
        except (OSError, KeyError, ValueError, urllib.error.URLError):
            return None
        return workers[0]["status"] if workers else None

    def worker_pid(self) -> int | None:
        """The pid of the model's worker process (a restart changes it)."""
        try:
            req = urllib.request.Request(
                f"http://127.0.0.1:{self.ports['management']}/models/{self.model_name}",
                headers={"Authorization": f"Bearer {self.key('management')}"},
            )
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read())[0]["workers"][0]["pid"]
        except (OSError, KeyError, IndexError, ValueError, urllib.error.URLError):
            return None

    def tail(self, n: int = 4000) -> str:
        out_file = self.workdir / "torchserve.out"
        out = out_file.read_text(errors="replace")[-n:] if out_file.exists() else ""
        return out + "\n--- model_log ---\n" + self.model_log()[-n:]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None and not _group_alive(self.proc.pid):
            return
        # The session started with our launcher: its Java frontend and Python workers are in it.
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.proc.pid):
                self.proc.poll()
                time.sleep(0.2)
            if not _group_alive(self.proc.pid):
                break
        self.proc.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies of the group count as gone.
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields_ = stat[stat.rindex(")") + 2 :].split()
        if int(fields_[2]) == pgid and fields_[0] != "Z":
            return True
    return False
