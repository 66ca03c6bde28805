"""``llm_api serve --ray``: the Ray Serve application on a Ray cluster, until SIGTERM or SIGINT.

It joins the cluster at ``--ray-address`` (or ``RAY_ADDRESS``), else starts a local one (a head on this
machine, no dashboard; it ends with this process), starts Ray Serve's HTTP proxy on ``--host``/``--port``,
runs ``llm_api.scale_out.deployments.application`` as the app ``llm_api`` at ``/``, logs one line when every
replica is ready, and on a signal deletes the app (replicas drain their streams for up to
``DRAIN_GRACE_S``; the stop waits that and 5 s more, then shuts Serve and the local cluster down whatever
is left). Exit 0 after a stop, 1 when the app fails to deploy. A local cluster also ends when this process
is killed outright: Ray ends its GCS and raylet itself, and ``reaper.py``, started before the cluster, ends
what Ray leaves (its node agents always; its workers, the replicas among them, where orphans go to a
subreaper).

Stored responses (``previous_response_id``) must be visible to every replica: with more than one replica
and ``RESPONSES_STORE_PATH`` unset, the replicas share an SQLite file in a directory made for this run
(deleted at the stop), which holds on one machine; across machines, set ``RESPONSES_STORE_PATH`` to a path
every node sees, or keep a chat's turns on one replica (the router does while load is balanced).

TLS (``SSL_KEYFILE`` and ``SSL_CERTFILE``, checked by the CLI before the cluster starts): Ray's proxy serves
HTTPS with them (Ray Serve's own ``HTTPOptions.ssl_keyfile``/``ssl_certfile``, handed to uvicorn, whose
context keeps Python's TLS 1.2 minimum); the paths handed over are absolute, since the proxy reads them in a
process of its own, and on a cluster of several machines each node that runs a proxy must have them at
those paths. Mutual TLS (``SSL_CA_CERTS``) is refused by the CLI (``llm_api.server.cli`` says why).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from llm_api.model.settings import Settings
from llm_api.scale_out.deployments import Scaling, application
from llm_api.server.auth import resolve_key
from llm_api.server.tls import ServerTLS

logger = logging.getLogger(__name__)

APP_NAME = "llm_api"
# A local cluster's sockets live under its root, at "<root>/session_<date>_<time>_<pid>/sockets/plasma_store":
# 62 characters past a root, and a socket's path may not pass 107 bytes. A longer root (a test's TMPDIR)
# is replaced by a short directory of our own under /tmp, removed at the stop.
MAX_RAY_ROOT_CHARS = 40
NODE_START_S = 240  # how long a local node may take to register (_patient_node_start)

# Ray's start-up deadlines assume idle cores: on a 2-core host busy with other work the node's agent took
# over 30 s to start and the HTTP proxy missed its 5 s readiness check three times (the start failed). A
# start that is slow is better than one that fails: longer deadlines, unless the environment sets its own.
# (Read by the processes Ray starts, which inherit this environment, and by Ray's modules as they are imported:
# set before ``import ray``.)
RAY_DEFAULTS = {
    "RAY_agent_register_timeout_ms": "180000",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",
    "RAY_USAGE_STATS_ENABLED": "0",  # (no usage report from a server)
    # Ray folds lines that look alike from different processes into "[repeated Nx across cluster]": each
    # request's own line (its id, how it ended) is what a server's log is for.
    "RAY_DEDUP_LOGS": "0",
}


def _patient_node_start() -> None:
    """Let a local node take up to ``NODE_START_S`` to register instead of Ray's fixed 30 s.

    Ray 2.60's ``Node`` waits 30 s (a constant in its code) for the raylet to register with the GCS, and the
    raylet registers only once its node agent, a Python process with a long import, has started: beside
    a running test suite on 2 cores that took longer, and the start failed ("The current node timed out
    during startup"). The wait is a loop around ``ray._private.services.get_node``, which raises until
    the node is registered; this makes that call wait (up to NODE_START_S) instead. Ray is pinned to the
    version this was read from (``ray[serve]==2.60.0``); if the function is gone, nothing is changed."""
    from ray._private import services

    original = getattr(services, "get_node", None)
    if original is None or getattr(original, "llm_api_patient", False):
        return

    def get_node(*args, **kwargs):
        deadline = time.monotonic() + NODE_START_S
        while True:
            try:
                found = original(*args, **kwargs)
                if found is not None or time.monotonic() > deadline:
                    return found
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.5)

    get_node.llm_api_patient = True  # type: ignore[attr-defined]
    services.get_node = get_node


def _log_start_failure(root: Path) -> None:
    """The last lines of the local node's own logs, which say why it did not start (they are otherwise
    deleted with the directory made for them)."""
    sessions = sorted(root.glob("session_2*"), key=lambda p: p.stat().st_mtime)
    if not sessions:
        return
    for name in ("raylet.out", "raylet.err", "gcs_server.err", "dashboard_agent.log", "runtime_env_agent.err"):
        path = sessions[-1] / "logs" / name
        if path.is_file():
            lines = path.read_text(errors="replace").splitlines()[-15:]
            logger.error("llm_api serve --ray: the local Ray node did not start; %s ends:\n%s", name, "\n".join(lines))


def _default_ray_root() -> str:
    """Where Ray puts a local cluster's files unless told: $RAY_TMPDIR, else <temporary directory>/ray."""
    return os.environ.get("RAY_TMPDIR") or os.path.join(tempfile.gettempdir(), "ray")


def http_options(settings: Settings, host: str, port: int, tls: ServerTLS | None) -> dict:
    """Ray Serve's ``HTTPOptions`` for its proxy."""
    # KEEPALIVE_TIMEOUT_S as Ray's proxy can take it (whole seconds, at least 1): an idle keep-alive
    # connection is closed as on `llm_api serve`. Its other transport guards have no option in Ray's
    # proxy (docs/scale-out.md, "Not done").
    options: dict = {"host": host, "port": port, "keep_alive_timeout_s": max(1, math.ceil(settings.keepalive_timeout_s))}
    if tls is not None:
        options.update(ssl_keyfile=str(tls.keyfile), ssl_certfile=str(tls.certfile))
    return options


def serve_on_ray(settings: Settings, host: str, port: int, key_file: Path, auth: bool, scaling: Scaling,
                 address: str | None, tls: ServerTLS | None = None) -> int:
    for name, value in RAY_DEFAULTS.items():
        os.environ.setdefault(name, value)
    import ray
    from ray import serve

    key, key_path = resolve_key(settings.api_key, key_file) if auth else (None, None)
    shared_store = None
    if not settings.responses_store_path and (scaling.replicas > 1 or scaling.max_replicas):
        shared_store = Path(tempfile.mkdtemp(prefix="llm_api-ray-"))
        settings = dataclasses.replace(settings, responses_store_path=str(shared_store / "responses.sqlite3"))
        logger.info("llm_api serve --ray: the replicas share stored responses in %s (RESPONSES_STORE_PATH unset)",
                    settings.responses_store_path)
    reaper = None
    if not address:
        _patient_node_start()
        # (before the cluster starts: what Ray leaves after a SIGKILL of this process, it ends; reaper.py)
        reaper = subprocess.Popen([sys.executable, "-m", "llm_api.scale_out.reaper", "--parent", str(os.getpid())],
                                  stdin=subprocess.DEVNULL)
    ray_root = None
    if not address and len(_default_ray_root()) > MAX_RAY_ROOT_CHARS:
        ray_root = Path(tempfile.mkdtemp(prefix="llm_api-ray-", dir="/tmp" if Path("/tmp").is_dir() else None))
        logger.info("llm_api serve --ray: Ray's files in %s (the temporary directory's path is too long for its "
                    "sockets)", ray_root)
    try:
        try:
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                     _temp_dir=None if ray_root is None else str(ray_root))
        except Exception:
            _log_start_failure(ray_root or Path(_default_ray_root()))
            raise
        serve.start(http_options=http_options(settings, host, port, tls), detached=False)
        stop = threading.Event()  # (after ray.init, which installs a SIGTERM handler of its own)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        try:
            serve.run(application(settings, key, scaling), name=APP_NAME, route_prefix="/", blocking=False)
        except Exception:
            logger.exception("llm_api serve --ray: the application failed to deploy")
            return 1
        logger.info("llm_api serve --ray: ready; model %s, %s replica(s)%s, HTTP %s://%s:%d, auth %s",
                    settings.model_name, scaling.replicas,
                    f" (autoscaling to {scaling.max_replicas})" if scaling.max_replicas else "",
                    "http" if tls is None else "https", host, port,
                    "off" if key is None else f"bearer key in {key_path}" if key_path else "bearer key from LLM_API_KEY")
        stop.wait()
        logger.info("llm_api serve --ray: stopping (replicas drain for up to DRAIN_GRACE_S=%g s)",
                    settings.drain_grace_s)
        # Bounded: a replica still loading holds the delete (and the controller) for as long as it loads;
        # past the bound the cluster is shut down under it.
        deleting = threading.Thread(target=lambda: (serve.delete(APP_NAME), serve.shutdown()), daemon=True)
        deleting.start()
        deleting.join(settings.drain_grace_s + 5)
        if deleting.is_alive():
            logger.warning("llm_api serve --ray: the app was not deleted within DRAIN_GRACE_S + 5 s; stopping Ray")
        logger.info("llm_api serve --ray: stopped")
        return 0
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for made in (shared_store, ray_root):
            if made is not None:
                shutil.rmtree(made, ignore_errors=True)
        if reaper is not None:  # (nothing of the cluster is left after ray.shutdown: the reaper has no work)
            reaper.kill()
            reaper.wait()
