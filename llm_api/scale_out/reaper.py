"""Ends the local Ray cluster's processes when ``llm_api serve --ray`` dies without its stop (SIGKILL, the OOM
killer).

    python -m llm_api.scale_out.reaper --parent PID

Why: after a SIGKILL of the server, Ray's two node agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``,
which also ignore SIGTERM) were left running, and where orphans go to a *subreaper* rather than pid 1 (a
test session, ``systemd --user``, some container inits) so were its workers: the Serve controller, the
proxy and every replica, holding their models, for as long as that subreaper lived (Ray 2.60.0, measured
both ways). ``serve_on_ray`` starts this module as a small child before it starts a local cluster. Every
``SCAN_S`` it notes the Ray processes below its parent (pid and start time: a pid the kernel reuses later is
not mistaken for one), and when its parent has gone it SIGKILLs those still running, the Ray processes they
started since the last scan, and the Ray processes left in its own process group (the agents, which a scan
may not yet have seen). After a normal stop
(``ray.shutdown``) none is left, and the server kills the reaper itself. A cluster joined with
``--ray-address`` is not ours: no reaper then. Standard library only (it starts in milliseconds and holds a
few MB); it reads ``/proc``, so it does nothing where there is none.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from pathlib import Path

POLL_S = 0.5  # how often the parent is checked
SCAN_S = 2.0  # how often the processes below it are noted (reads every /proc/<pid>/stat: some ms)
RAY_PACKAGE = re.compile(rb"[/\\](site|dist)-packages[/\\]ray[/\\]")


def is_ray_process(command: bytes) -> bool:
    """A Ray process, from its ``/proc/<pid>/cmdline``: a Ray process title (``ray::DashboardAgent``,
    ``ray::IDLE``) or a program of the ``ray`` package (its binaries, or Python running one of its scripts)."""
    words = command.split(b"\0")
    return words[0].startswith(b"ray::") or any(RAY_PACKAGE.search(word) for word in words[:3])


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None once it has gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def _identity_from(pid: int, fields: list[str] | None) -> tuple[int, str] | None:
    return None if fields is None or fields[0] == "Z" else (pid, fields[19])


def identity_of(pid: int) -> tuple[int, str] | None:
    """(pid, start time) while the process runs (a zombie has ended): a reused pid gives another identity."""
    return _identity_from(pid, _stat(pid))


def _is_ray(pid: int) -> bool:
    try:
        return is_ray_process(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


def _processes() -> list[tuple[int, list[str]]]:
    """Every process with the fields of its ``stat`` (read once), from ``/proc`` (none without it)."""
    proc = Path("/proc")
    pids = [int(entry.name) for entry in proc.iterdir() if entry.name.isdigit()] if proc.is_dir() else []
    return [(pid, fields) for pid in pids if (fields := _stat(pid)) is not None]


def ray_processes_below(*roots: int) -> set[tuple[int, str]]:
    """The running Ray processes below any of ``roots`` (every generation), by identity."""
    processes = _processes()
    children: dict[int, list[tuple[int, list[str]]]] = {}
    for pid, fields in processes:
        children.setdefault(int(fields[1]), []).append((pid, fields))
    found, stack = set(), [child for root in roots for child in children.get(root, [])]
    while stack:
        pid, fields = stack.pop()
        stack.extend(children.get(pid, []))
        identity = _identity_from(pid, fields)
        if identity is not None and _is_ray(pid):
            found.add(identity)
    return found


def ray_processes_in_group(group: int) -> set[tuple[int, str]]:
    """The running Ray processes whose process group is ``group``, but this one, by identity."""
    return {identity for pid, fields in _processes()
            if pid != os.getpid() and int(fields[2]) == group and (identity := _identity_from(pid, fields))
            and _is_ray(pid)}


def _still_running(identities: set[tuple[int, str]]) -> set[tuple[int, str]]:
    return {identity for identity in identities if identity_of(identity[0]) == identity}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C reaches the whole group: the server handles it)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (and a group's SIGTERM: stay until the server has gone)
    noted: set[tuple[int, str]] = set()
    scanned = 0.0
    while os.getppid() == args.parent:
        if time.monotonic() - scanned >= SCAN_S:
            noted = _still_running(noted) | ray_processes_below(args.parent)
            scanned = time.monotonic()
        time.sleep(POLL_S)
    # What the last scan noted, and what the noted processes started since (a worker the raylet was
    # starting when the parent died: seen once, it would live on until its start-up noticed the raylet gone)
    noted = _still_running(noted)
    noted |= ray_processes_below(*(pid for pid, _ in noted))
    for pid, started in noted | ray_processes_in_group(os.getpgrp()):
        if identity_of(pid) == (pid, started):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
