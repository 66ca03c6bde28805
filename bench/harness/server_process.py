"""What every real server that tests and benchmarks start has in common: ``ServerProcess``.

A subclass says what its server is (``_command``: the command line; its URLs, key file, log files and
worker probes); the base class runs it the same way for all of them: its own working directory, free
loopback ports (``port_names``), an environment with its own TMPDIR, the process started in a new
session under ``bench/harness/process_guard.py`` (``launch``: the guard and everything the server forks form one
process group, and the guard ends that group when the process that started it dies, however it dies),
``wait_ready`` polling ``worker_status()`` until READY, the log helpers, and ``stop()``: SIGTERM to that
process group, SIGKILL if it has not ended in time, never a signal to any other process.

Footprint (a test run must fit a 2-core, 24 GiB host with room to spare: README, "Testing"): at most
``MAX_LIVE_SERVERS`` servers run at once in one test process (``start()`` refuses one more, naming those
alive: a test that needs more must stop one first), a server's KV pool is ``TEST_KV_CACHE_MEMORY_MIB``
unless the caller's ``env`` sizes it, and servers do not inherit the tests' ``TRITON_INTERPRET`` (a CPU
server runs no Triton kernel, and with the variable set it would load Triton: 73 MB each).

Front-end surface the subclasses share (tests parametrized over both kinds use only these): ``kind``,
``model_name``, ``scheme``, ``url_context()``, ``http``, ``grpc``, ``native_url``, ``openai_base``, ``ready_url``,
``metrics_url``, ``key()``, ``model_log()``, ``wait_for_log_lines()``, ``worker_status()``, ``worker_pid()``, ``stop()``.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from abc import ABC, abstractmethod
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import ClassVar, Self

REPO = Path(__file__).resolve().parents[2]
GUARD = Path(__file__).resolve().parent / "process_guard.py"
MAX_LIVE_SERVERS = 2  # per test process (module docstring, footprint)
# Enough for one request of the default MAX_INPUT_TOKENS + MAX_NEW_TOKENS (4,096 tokens) in float32, the
# largest a test sends; a CPU pool is resident only as far as it is used (llm_api.engine.kv_cache).
TEST_KV_CACHE_MEMORY_MIB = "192"


def launch(command: list[str], *, cwd: Path, env: dict[str, str], out, pid_file: Path) -> subprocess.Popen:
    """Start ``command`` under the process guard, as the leader of a new session (module docstring); the
    guard writes the command's own pid to ``pid_file``."""
    pid_file.unlink(missing_ok=True)
    return subprocess.Popen([sys.executable, str(GUARD), "--parent", str(os.getpid()), "--pid-file", str(pid_file),
                             "--", *command], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def guarded_pid(pid_file: Path, timeout: float = 10) -> int | None:
    """The pid the guard wrote to ``pid_file`` (None if it has not within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return int(pid_file.read_text())
        except (OSError, ValueError):
            time.sleep(0.02)
    return None


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports: all sockets are held open together while the kernel picks, since
    one bound and closed at a time may be handed out twice. Under pytest-xdist each worker takes only the
    ports whose half (port // 2) modulo the worker count is its own index: a port is free from the moment it is
    picked until the server binds it seconds later, and in that window another worker's pick could land
    on it; with the ports split by residue no two workers can ever pick the same one."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket()
            sockets.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            # By port // 2: Linux hands odd ports to bind(0) first (even ones are kept for connect()), so
            # the port's own residue would starve every even-numbered worker when two run.
            if (port // 2) % workers == index % workers:
                ports.append(port)
            if len(sockets) > 1000 * count:
                raise RuntimeError(f"no {count} free ports for xdist worker {index} of {workers}")
        return ports
    finally:
        for s in sockets:
            s.close()


@dataclass
class ServerProcess(ABC):
    workdir: Path
    _: KW_ONLY
    model_name: str = "smollm2"
    env: dict = field(default_factory=dict)  # over os.environ and the server's own variables; None unsets one
    proc: subprocess.Popen | None = None
    ports: dict = field(default_factory=dict)

    live: ClassVar[list["ServerProcess"]] = []  # started and not yet stopped, in this process

    kind: ClassVar[str]  # "torchserve" or "standalone": what tests parametrized over both branch on
    program: ClassVar[str]  # the server's name in error messages
    port_names: ClassVar[tuple[str, ...]]  # the ports start() takes (``ports[name]``)
    http_port: ClassVar[str]  # the one that serves the inference API, at the paths below
    openai_path: ClassVar[str]  # the OpenAI-compatible routes' base ("{model}": the model's name)
    ready_path: ClassVar[str]  # 200 once the model serves requests
    metrics_port: ClassVar[str]  # the one that serves /metrics
    metrics_need_key: ClassVar[bool] = False  # /metrics answers only with the key (llm_api serve's default)
    out_name: ClassVar[str]  # the file in workdir that takes the process's stdout and stderr
    model_log_name: ClassVar[str]  # the file in workdir with the model's log lines (``request ... ended``)
    stop_grace: ClassVar[float]  # how long stop() waits after SIGTERM before SIGKILL

    # -------------------------------------------------------------------------------------------
    # what a subclass says besides the above

    @abstractmethod
    def _command(self) -> list[str]:
        """The command line, built once the ports are taken (it may write the config files it names)."""

    def _env_defaults(self, tmp: Path) -> dict[str, str]:
        """The server's own variables: over os.environ, under the caller's ``env``."""
        return {}

    @abstractmethod
    def key(self, kind: str = "inference") -> str: ...

    @abstractmethod
    def worker_status(self) -> str | None:
        """``"READY"`` once the model serves requests; None while it does not (or cannot be asked)."""

    @abstractmethod
    def worker_pid(self) -> int | None:
        """The pid of the process that runs the model, or None."""

    # -------------------------------------------------------------------------------------------
    # the same for every server

    @property
    def scheme(self) -> str:
        """``http``, or ``https`` where the server speaks TLS (``url_context`` then says how to reach it)."""
        return "http"

    def url_context(self) -> ssl.SSLContext | None:
        """What urllib needs to reach an ``https`` server (its CA, a client certificate); None for plain HTTP."""
        return None

    @property
    def http(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.ports[self.http_port]}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def native_url(self) -> str:
        return f"{self.http}/predictions/{self.model_name}"

    @property
    def openai_base(self) -> str:
        return self.http + self.openai_path.format(model=self.model_name)

    @property
    def ready_url(self) -> str:
        return self.http + self.ready_path.format(model=self.model_name)

    @property
    def metrics_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.ports[self.metrics_port]}/metrics"

    def metrics_text(self, timeout: float = 30) -> str:
        """``/metrics`` as text: with the key where the server needs one for it (``llm_api serve``'s default,
        METRICS_PUBLIC unset), without on TorchServe's metrics port."""
        try:
            headers = {"Authorization": f"Bearer {self.key()}"} if self.metrics_need_key else {}
        except OSError:  # (no key file: auth off)
            headers = {}
        request = urllib.request.Request(self.metrics_url, headers=headers)
        with urllib.request.urlopen(request, timeout=timeout, context=self.url_context()) as response:
            return response.read().decode()

    @property
    def out_path(self) -> Path:
        return self.workdir / self.out_name

    def model_log(self) -> str:
        return _read_text(self.workdir / self.model_log_name)

    def wait_for_log_lines(self, needle: str, count: int = 1, timeout: float = 10) -> list[str]:
        """The model-log lines holding ``needle`` once there are ``count`` of them (or at ``timeout``): a
        log line may reach its file a moment after the response that follows it."""
        deadline = time.monotonic() + timeout
        while True:
            lines = [line for line in self.model_log().splitlines() if needle in line]
            if len(lines) >= count or time.monotonic() > deadline:
                return lines
            time.sleep(0.05)

    def tail(self, n: int = 4000) -> str:
        """The end of the process's output (for error messages)."""
        return _read_text(self.out_path)[-n:]

    @property
    def pid_file(self) -> Path:
        return self.workdir / "server.pid"

    def server_pid(self) -> int | None:
        """The server process's own pid (the guard's child), while the guard runs."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        return guarded_pid(self.pid_file)

    def _environment(self) -> dict[str, str]:
        tmp = self.workdir / "tmp"
        tmp.mkdir(exist_ok=True)
        inherited = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        merged = {**inherited, "TMPDIR": str(tmp), "KV_CACHE_MEMORY_MIB": TEST_KV_CACHE_MEMORY_MIB,
                  **self._env_defaults(tmp), **self.env}
        return {name: value for name, value in merged.items() if value is not None}  # (None: unset)

    def start(self, wait_ready: bool = True, timeout: float = 240) -> Self:
        alive = [server for server in ServerProcess.live if server is not self and server._running()]
        if len(alive) >= MAX_LIVE_SERVERS:
            names = ", ".join(str(s.workdir) for s in alive)
            raise RuntimeError(f"{len(alive)} servers already run in this test process ({names}); the suite allows "
                               f"{MAX_LIVE_SERVERS} at once (bench/harness/server_process.py): stop one first")
        ServerProcess.live[:] = alive
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ports = dict(zip(self.port_names, free_ports(len(self.port_names))))
        command = self._command()
        with open(self.out_path, "wb") as out:  # (the child holds its own copy of the file)
            self.proc = launch(command, cwd=self.workdir, env=self._environment(), out=out, pid_file=self.pid_file)
        ServerProcess.live.append(self)
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 240) -> None:
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.program} exited with {self.proc.returncode}:\n{self.tail()}")
            if self.worker_status() == "READY":
                return
            time.sleep(0.3)
        raise TimeoutError(f"{self.program} not ready after {timeout}s:\n{self.tail()}")

    def stop(self, grace: float | None = None) -> int | None:
        """Stop the process group (SIGTERM, then SIGKILL after ``grace`` seconds, ``stop_grace`` unless
        given); the server's exit status (None if it was never started)."""
        if self.proc is None:
            return None
        ServerProcess.live[:] = [server for server in ServerProcess.live if server is not self]
        for sig, wait in ((signal.SIGTERM, self.stop_grace if grace is None else grace), (signal.SIGKILL, 10)):
            if not self._running():
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and self._running():
                time.sleep(0.1)
        return self.proc.poll()

    def _running(self) -> bool:
        """The server or anything it forked is still alive (poll() also reaps the server once it ended)."""
        assert self.proc is not None
        return self.proc.poll() is None or _group_alive(self.proc.pid)


def _read_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


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
