"""A real ``llm_api serve`` for tests and benchmarks, with the same surface as ``torchserve_server.TorchServe``.

``StandaloneServer.start()`` runs ``python -m llm_api.server serve`` in a new process session with its
own free loopback ports, working directory and TMPDIR; the key is the one the server generates into its
key file (``key()`` reads it). ``model_log()`` is the process's output (the service's log lines:
``request ... ended ...; KV blocks free a/b``). ``stop()`` sends SIGTERM (the server drains and exits)
and SIGKILL if it has not exited in time, to this process group only.

Front-end surface shared with ``TorchServe`` (tests parametrized over both use only these): ``kind``,
``model_name``, ``http``, ``grpc``, ``native_url``, ``openai_base``, ``ready_url``, ``metrics_url``,
``key()``, ``model_log()``, ``wait_for_log_lines()``, ``worker_status()``, ``worker_pid()``, ``stop()``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from torchserve_server import REPO, _group_alive, free_port


@dataclass
class StandaloneServer:
    workdir: Path
    model_name: str = "smollm2"
    env: dict = field(default_factory=dict)
    args: list = field(default_factory=list)
    proc: subprocess.Popen | None = None
    ports: dict = field(default_factory=dict)
    kind: str = "standalone"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def native_url(self) -> str:
        return f"{self.http}/predictions/{self.model_name}"

    @property
    def openai_base(self) -> str:
        return f"{self.http}/v1"

    @property
    def ready_url(self) -> str:
        return f"{self.http}/ready"

    @property
    def metrics_url(self) -> str:
        return f"{self.http}/metrics"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def key(self, kind: str = "inference") -> str:
        return (self.workdir / "llm_api.key").read_text().strip()

    def model_log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_for_log_lines(self, needle: str, count: int = 1, timeout: float = 10) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            lines = [line for line in self.model_log().splitlines() if needle in line]
            if len(lines) >= count or time.monotonic() > deadline:
                return lines
            time.sleep(0.05)

    def start(self, wait_ready: bool = True, timeout: float = 240) -> "StandaloneServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ports = {"http": free_port(), "grpc": free_port()}
        tmp = self.workdir / "tmp"
        tmp.mkdir(exist_ok=True)
        env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO), **self.env}
        if "LLM_API_KEY" not in self.env:
            env.pop("LLM_API_KEY", None)  # the server generates its key (key() reads it)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llm_api.server", "serve", "--port", str(self.ports["http"]),
             "--grpc-port", str(self.ports["grpc"]), *self.args],
            cwd=self.workdir, env=env, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llm_api serve exited with {self.proc.returncode}:\n{self.tail()}")
            if self.worker_status() == "READY":
                return
            time.sleep(0.3)
        raise TimeoutError(f"llm_api serve not ready after {timeout}s:\n{self.tail()}")

    def worker_status(self) -> str | None:
        try:
            with urllib.request.urlopen(self.ready_url, timeout=5) as resp:
                return "READY" if resp.status == 200 else None
        except (OSError, urllib.error.URLError):
            return None

    def worker_pid(self) -> int | None:
        """The process that runs the model (the server itself: there is no separate worker)."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def tail(self, n: int = 4000) -> str:
        return self.model_log()[-n:]

    def stop(self, grace: float = 30) -> int | None:
        if self.proc is None:
            return None
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None and not _group_alive(self.proc.pid):
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and (self.proc.poll() is None or _group_alive(self.proc.pid)):
                time.sleep(0.1)
        return self.proc.poll()
