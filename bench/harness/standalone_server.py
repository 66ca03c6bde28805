"""A real ``llm_api serve`` for tests and benchmarks, with the same surface as ``torchserve_server.TorchServe``.

``StandaloneServer.start()`` runs ``python -m llm_api.server serve`` as a ``server_process.ServerProcess``
(a new process session with its own free loopback ports, working directory and TMPDIR); the key is the
one the server generates into its key file (``key()`` reads it). ``model_log()`` is the process's output
(the service's log lines: ``request ... ended ...; KV blocks free a/b``). ``stop()`` sends SIGTERM (the
server drains and exits) and SIGKILL if it has not exited in time, to this process group only, and
returns the server's exit status. A server given TLS files (``SSL_*`` in ``env`` or ``--ssl-*`` in ``args``)
needs ``tls``, the client side of them (``llm_api.client.ClientTLS``): its URLs are then ``https://`` and its
probes (``worker_status``, ``metrics_text``) check the server's certificate with that CA and show the client
certificate a mutual-TLS server asks for.
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .server_process import REPO, ServerProcess

if TYPE_CHECKING:  # (the harness imports llm_api only where it needs it, as its other modules do)
    from llm_api.client import ClientTLS


@dataclass(kw_only=True)
class StandaloneServer(ServerProcess):
    args: list = field(default_factory=list)  # more `llm_api serve` options
    tls: ClientTLS | None = None  # the server speaks TLS: how its clients (the probes here) reach it

    kind = "standalone"
    program = "llm_api serve"
    port_names = ("http", "grpc")
    http_port = "http"
    openai_path = "/v1"
    ready_path = "/ready"
    metrics_port = "http"
    metrics_need_key = True  # (METRICS_PUBLIC unset)
    out_name = "server.log"
    model_log_name = "server.log"  # the service logs to the process's output
    stop_grace = 30  # the server drains its requests on SIGTERM (DRAIN_GRACE_S)

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "llm_api.server", "serve", "--port", str(self.ports["http"]),
                "--grpc-port", str(self.ports["grpc"]), *self.args]

    def _env_defaults(self, tmp: Path) -> dict[str, str]:
        return {"PYTHONPATH": str(REPO)}

    def _environment(self) -> dict[str, str]:
        env = super()._environment()
        if "LLM_API_KEY" not in self.env:
            env.pop("LLM_API_KEY", None)  # the server generates its key (key() reads it)
        return env

    def stop(self, grace: float | None = None) -> int | None:
        """As ``ServerProcess.stop``; under ``--ray`` the server alone gets the SIGTERM first (it deletes the
        app and shuts its Ray cluster down, whose workers run in sessions of their own, out of reach of
        the group's signals) and the group the rest. (The server, not ``self.proc``: that is the process
        guard, which leaves the group's signals to its child, so a SIGTERM to it alone did nothing and the
        stop waited its whole grace for a server that had never been asked to stop.)"""
        pid = self.server_pid() if "--ray" in self.args else None
        if pid is not None:
            assert self.proc is not None
            try:
                os.kill(pid, signal.SIGTERM)
                self.proc.wait(self.stop_grace if grace is None else grace)  # (the guard ends with its child)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        return super().stop(grace)

    def key(self, kind: str = "inference") -> str:
        return (self.workdir / "llm_api.key").read_text().strip()

    @property
    def scheme(self) -> str:
        return "http" if self.tls is None else "https"

    def url_context(self) -> ssl.SSLContext | None:
        return None if self.tls is None else self.tls.ssl_context()

    def worker_status(self) -> str | None:
        try:
            with urllib.request.urlopen(self.ready_url, timeout=5, context=self.url_context()) as resp:
                return "READY" if resp.status == 200 else None
        except (OSError, urllib.error.URLError):
            return None

    def worker_pid(self) -> int | None:
        """The process that runs the model (the server itself: there is no separate worker)."""
        return self.server_pid()
