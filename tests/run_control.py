"""How a parallel test run ends when one of its pytest-xdist workers dies, and what may outlive it.

A worker can die without a test failing: the kernel's OOM killer, a segfault in native code, ``os._exit``.
pytest-xdist's own handling, with the group scheduling the suite uses (``--dist loadgroup``), puts the dead
worker's unfinished group back in the queue for a replacement worker that never takes it (reproduced in a
nested run: the controller and every worker then wait on their queues forever, using no CPU). This plugin
makes that case fail fast and loud instead:

* **controller** (``WorkerCrash``): when a worker goes down with an error, every test of the work it held
  that had not completed is reported failed at once, the test that was running first, each naming the
  worker and why it died (its exit status or signal, and the kernel's OOM line for its pid where the kernel
  log can be read); the work is marked done so that nothing is re-queued; a stop file is written; and one
  line in the summary says how many tests were not run. ``scripts/test.sh`` passes ``--max-worker-restart 0``
  so that xdist starts no replacement and shuts the run down.
* **workers** (``StopFlag``): before each test's setup (so no fixture starts a server), a worker that finds
  the stop file skips the test, naming the dead worker. The live workers therefore run out their queues in
  seconds after the test each is in, and the run ends: well within a minute unless a test in progress runs
  longer than that by itself.

``ProcessSweep`` (controller, and a serial run's only process) makes the run's root a *child subreaper*
(``PR_SET_CHILD_SUBREAPER``): a process whose parent died is re-parented to it instead of to pid 1. At the
end of the run every process still below it is listed in the summary as a leak and ended by its pid: SIGTERM,
then SIGKILL after a grace. The servers' own guard (``bench/harness/process_guard.py``) ends a server when the test
process that started it dies; the sweep is the net beneath it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

STOP_FILE_KEY = "llm_api_stop_file"  # in each worker's workerinput
PR_SET_CHILD_SUBREAPER = 36
SWEEP_GRACE_S = 5.0


def _write_line(config: pytest.Config, line: str, **markup: bool) -> None:
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line, **markup)


def kernel_log_lines(pid: int) -> list[str]:
    """The kernel log's lines about ``pid`` (the OOM killer names the process it killed), or [] when the
    log cannot be read (no permission, no ``dmesg``)."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    needles = (f"process {pid} ", f"pid={pid},", f"pid {pid} ", f"Killed process {pid}")
    return [line.strip() for line in out.splitlines() if any(n in line for n in needles)][-3:]


def describe_death(node: Any, error: object) -> str:
    """Why a worker went down, as far as can be told: its exit status or signal, and the kernel's words."""
    popen = getattr(getattr(getattr(node, "gateway", None), "_io", None), "popen", None)
    parts = [str(error)]
    if popen is not None:
        try:
            status = popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = None
        if status is not None and status < 0:
            parts.append(f"killed by {signal.Signals(-status).name}")
        elif status is not None:
            parts.append(f"exit status {status}")
        lines = kernel_log_lines(popen.pid)
        parts.append("kernel log: " + " | ".join(lines) if lines else "kernel log: nothing about its pid (or unreadable)")
    return "; ".join(parts)


class WorkerCrash:
    """Controller side (module docstring)."""

    def __init__(self, config: pytest.Config, stop_file: Path):
        self.config = config
        self.stop_file = stop_file
        self.crashes: list[str] = []
        self.num_failed_by_crash = 0

    @pytest.hookimpl
    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[STOP_FILE_KEY] = str(self.stop_file)

    @pytest.hookimpl(tryfirst=True)
    def pytest_testnodedown(self, node: Any, error: object | None) -> None:
        if error is None or error == "keyboard-interrupt":
            return
        worker = node.gateway.id
        why = describe_death(node, error)
        dsession = self.config.pluginmanager.getplugin("dsession")
        assigned = getattr(getattr(dsession, "sched", None), "assigned_work", {}).get(node, {})
        # loadscope / loadgroup: {scope: {nodeid: completed}}; mark it all done, so that nothing is re-queued.
        pending = [nodeid for unit in assigned.values() if isinstance(unit, dict)
                   for nodeid, done in unit.items() if not done]
        for unit in assigned.values():
            if isinstance(unit, dict):
                for nodeid in unit:
                    unit[nodeid] = True
        summary = f"worker {worker} died ({why})"
        self.crashes.append(summary)
        self.stop_file.write_text(summary)
        _write_line(self.config, f"\n{summary}: {len(pending)} of its tests failed with it; stopping the run",
                    red=True, bold=True)
        for position, nodeid in enumerate(pending):
            what = "while running this test" if position == 0 else f"before this test ran ({pending[0]} was running)"
            report = pytest.TestReport(nodeid=nodeid, location=(nodeid.split("::")[0], None, nodeid), keywords={},
                                       outcome="failed", longrepr=f"{summary} {what}", when="call")
            report.node = node  # type: ignore[attr-defined]  # (xdist's reporters read it)
            self.config.hook.pytest_runtest_logreport(report=report)
        self.num_failed_by_crash += len(pending)

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for line in self.crashes:
            terminalreporter.write_sep("!", line, red=True)


class StopFlag:
    """Worker side (module docstring): skip what is left once a worker died."""

    def __init__(self, stop_file: Path):
        self.stop_file = stop_file

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if self.stop_file.exists():
            pytest.skip(f"not run: {self.stop_file.read_text(errors='replace')}")


class ProcessSweep:
    """The run's root as a child subreaper, and the end-of-run sweep (module docstring)."""

    def __init__(self, config: pytest.Config):
        self.config = config
        libc = ctypes.CDLL(None, use_errno=True)
        self.enabled = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if not self.enabled:
            return
        _reap_zombie_children()  # (processes that ended after their parent: re-parented here, not leaks)
        leaked = descendants(os.getpid())
        if not leaked:
            return
        names = ", ".join(f"{pid} ({_command(pid)})" for pid in leaked[:10])
        print(f"\nprocess sweep: {len(leaked)} processes outlived the tests that started them, ended now: {names}")
        for sig, wait in ((signal.SIGTERM, SWEEP_GRACE_S), (signal.SIGKILL, 0.0)):
            for pid in leaked:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while wait and time.monotonic() < deadline and any(_alive(pid) for pid in leaked):
                time.sleep(0.1)
        _reap_zombie_children()


def _reap_zombie_children() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def descendants(root: int) -> list[int]:
    """Every live process below ``root``, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, frontier = [], list(children.get(root, []))
    while frontier:
        pid = frontier.pop(0)
        found.append(pid)
        frontier.extend(children.get(pid, []))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
    except OSError:
        return "?"


def register(config: pytest.Config, stop_file: Path) -> None:
    """Install the parts that belong in this process: the controller's (or a serial run's) and a worker's."""
    if hasattr(config, "workerinput"):
        path = config.workerinput.get(STOP_FILE_KEY)
        if path:
            config.pluginmanager.register(StopFlag(Path(path)), "llm_api-stop-flag")
        return
    config.pluginmanager.register(ProcessSweep(config), "llm_api-process-sweep")
    if config.pluginmanager.hasplugin("xdist") and getattr(config.option, "numprocesses", None):
        config.pluginmanager.register(WorkerCrash(config, stop_file), "llm_api-worker-crash")
