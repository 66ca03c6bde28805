"""A real TorchServe for tests and benchmarks: own ports, own TMPDIR and working directory, stopped by its pid.

``TorchServe.start()`` builds the archive (a folder, or a ``.mar``) from the repo's handler and the
given model-config, writes a config.properties that is the shipped one with free loopback ports, and
starts ``torchserve --foreground`` as a ``server_process.ServerProcess``, in a new process session.
``stop()`` signals that session (the launcher, its Java frontend and the Python workers it forked) and
nothing else.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from .server_process import REPO, ServerProcess

BIN = Path(sys.executable).parent


def build_archive(workdir: Path, model_name: str, model_config: str | None, mar: bool = False,
                  extra_files: tuple[Path, ...] = ()) -> Path:
    store = workdir / "model-store"
    store.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(BIN / "torch-model-archiver"), "--model-name", model_name, "--version", "1.0",
        "--handler", str(REPO / "llm_api" / "torchserve" / "llm_handler.py"),
        "--export-path", str(store), "--force",
    ]
    if not mar:
        cmd += ["--archive-format", "no-archive"]
    if extra_files:  # (a folder's contents land at the archive's root)
        cmd += ["--extra-files", ",".join(str(p) for p in extra_files)]
    if model_config is not None:
        cfg = workdir / "model-config.yaml"
        cfg.write_text(model_config)
        cmd += ["--config-file", str(cfg)]
    # The archiver stages the archive in $TMPDIR/<model name> and deletes that folder when done: two builds
    # of one model name at once (xdist workers, another checkout's tests) would delete each other's.
    staging = workdir / "archiver-tmp"
    staging.mkdir(exist_ok=True)
    subprocess.run(cmd, check=True, cwd=workdir, env={**os.environ, "TMPDIR": str(staging)})
    return store


@dataclass(kw_only=True)
class TorchServe(ServerProcess):
    model_config: str | None = None
    mar: bool = False
    extra_properties: str = ""  # appended to the shipped config.properties (a user's own settings)
    extra_files: tuple[Path, ...] = ()  # torch-model-archiver --extra-files
    _store: Path | None = field(default=None, init=False, repr=False)  # the model store start() built

    kind = "torchserve"
    program = "torchserve"
    port_names = ("inference", "management", "metrics", "grpc", "grpc_mgmt")
    http_port = "inference"
    openai_path = "/predictions/{model}/1.0/v1"
    ready_path = "/predictions/{model}/1.0/v1/health"
    metrics_port = "metrics"
    out_name = "torchserve.out"
    model_log_name = "logs/model_log.log"  # (the frontend writes the worker's output there: LOG_LOCATION)
    stop_grace = 15

    def start(self, wait_ready: bool = True, timeout: float = 240) -> Self:
        # The archive before the ports are taken: they are free only until someone binds them.
        self._store = build_archive(self.workdir, self.model_name, self.model_config, self.mar, self.extra_files)
        return super().start(wait_ready, timeout)

    def _command(self) -> list[str]:
        shipped = (REPO / "config.properties").read_text()
        props = re.sub(r"(?m)^(inference|management|metrics)_address=.*$",
                       lambda m: f"{m.group(1)}_address=http://127.0.0.1:{self.ports[m.group(1)]}", shipped)
        props = re.sub(r"(?m)^grpc_inference_port=.*$", f"grpc_inference_port={self.ports['grpc']}", props)
        props = re.sub(r"(?m)^grpc_management_port=.*$", f"grpc_management_port={self.ports['grpc_mgmt']}", props)
        props = re.sub(r"(?m)^model_store=.*$", f"model_store={self._store}", props)
        (self.workdir / "config.properties").write_text(props + self.extra_properties)
        target = self.model_name + (".mar" if self.mar else "")
        return [str(BIN / "torchserve"), "--start", "--foreground", "--ncs", "--ts-config", "config.properties",
                "--model-store", str(self._store), "--models", f"{self.model_name}={target}"]

    def _env_defaults(self, tmp: Path) -> dict[str, str]:
        # TEMP too: the Java frontend takes its temp dir (and the worker socket's) from it, not TMPDIR.
        return {"TEMP": str(tmp), "LOG_LOCATION": str(self.log_dir), "METRICS_LOCATION": str(self.log_dir)}

    def _environment(self) -> dict[str, str]:
        env = super()._environment()
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        return env

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    def key(self, kind: str = "inference") -> str:
        return json.loads((self.workdir / "key_file.json").read_text())[kind]["key"]

    def worker_status(self) -> str | None:
        workers = self._workers(timeout=5)
        return workers[0]["status"] if workers else None

    def worker_pid(self) -> int | None:
        """The pid of the model's worker process (a restart changes it)."""
        workers = self._workers(timeout=30)
        return workers[0].get("pid") if workers else None

    def _workers(self, timeout: float) -> list[dict] | None:
        """The model's workers as the management API describes them, or None when it cannot be asked."""
        try:
            req = urllib.request.Request(
                f"http://127.0.0.1:{self.ports['management']}/models/{self.model_name}",
                headers={"Authorization": f"Bearer {self.key('management')}"},
            )
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())[0]["workers"]
        except (OSError, KeyError, IndexError, ValueError, urllib.error.URLError):
            return None

    def tail(self, n: int = 4000) -> str:
        return super().tail(n) + "\n--- model_log ---\n" + self.model_log()[-n:]
