#!/usr/bin/env python3
"""Run a command and report the peak memory of it and every process it starts (the suite's footprint).

    python3 scripts/peak_memory.py [--interval S] [--report FILE] -- make test

The command runs as a child of this script, which makes itself a *child subreaper* (``PR_SET_CHILD_SUBREAPER``)
first: a process whose parent dies (a server whose test worker was killed) is then re-parented here instead of
to pid 1, so it is still counted, and it is reported by pid at the end if it outlived the command. Every
``--interval`` seconds (1) the script sums, over its descendants, each process's resident set (RSS from
``statm``: shared pages counted in every process that maps them, an upper bound) and, every fifth sample and
whenever the RSS total sets a new peak, the proportional set (PSS from ``smaps_rollup``: shared
pages divided among the processes that map them, what the processes take from the machine together; reading
it walks each process's page tables, so not every time). It prints the peak of each, the processes alive at
the PSS peak (largest first), the lowest ``MemAvailable`` the kernel reported during the run, how busy the
host's cores were over the run (``/proc/stat``: the whole host, so quiet neighbours are assumed; it says
whether the command was bound by the cores or waited), where the CPU time went (each process's own user +
system time as last sampled, summed by kind: servers, TorchServe's workers and frontends, the test workers, Ray;
processes that lived under one interval are missed), and the command's exit status, which is also this
script's. Linux only; standard library only (it runs before any set-up).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
MIB = 1024 * 1024


@dataclass
class Sample:
    at_s: float
    rss: int  # bytes, summed over the processes
    pss: int
    processes: list[tuple[int, int, int, str]] = field(default_factory=list)  # (pid, rss, pss, command line)


def children_of() -> tuple[dict[int, list[int]], set[int]]:
    """(parent pid -> child pids, the zombies), for every process visible in /proc."""
    tree: dict[int, list[int]] = {}
    zombies = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        tree.setdefault(int(fields[1]), []).append(int(entry))
        if fields[0] == "Z":
            zombies.add(int(entry))
    return tree, zombies


def descendants(root: int, keep: int) -> list[int]:
    """The live processes below ``root``. Zombies re-parented to ``root`` (a subreaper) are reaped here,
    except ``keep`` (the command itself, which ``Popen.wait`` reaps)."""
    tree, zombies = children_of()
    for pid in tree.get(root, []):
        if pid in zombies and pid != keep:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    found, stack = [], list(tree.get(root, []))
    while stack:
        pid = stack.pop()
        if pid not in zombies:
            found.append(pid)
        stack.extend(tree.get(pid, []))
    return found


PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_of(pid: int) -> int | None:
    """RSS in bytes (``statm``: cheap), or None once the process has gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None


def pss_of(pid: int) -> int:
    """PSS in bytes (``smaps_rollup`` walks the page tables: some ms for a GB-sized process), 0 once gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


_COMMANDS: dict[int, str] = {}


def command_line(pid: int) -> str:
    """A process's command line (read once per pid: it does not change after exec, which is long past)."""
    if pid not in _COMMANDS:
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return "?"
        _COMMANDS[pid] = raw.replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    return _COMMANDS[pid]


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds_of(pid: int) -> float | None:
    """The process's own user + system time so far (``stat``; its waited-for children are not included)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


# (needle in the command line as read, its first 160 characters; the kind it is reported as): the first that matches
KINDS = (("process_guard.py", "process guards"),
         ("llm_api.server serve", "llm_api serve (test servers)"),
         ("model_service_worker.py", "TorchServe model workers"),
         ("java ", "TorchServe frontends (Java)"),
         ("exec(eval(sys.stdin.readline()))", "pytest-xdist workers (tests run in them)"),
         ("-m pytest", "pytest (controller, nested runs)"),
         ("schemathesis", "schemathesis"),
         ("ray", "Ray (raylet, GCS, workers)"))


def kind_of(command: str) -> str:
    for needle, kind in KINDS:
        if needle in command:
            return kind
    return "other: " + " ".join(Path(word).name for word in command.split()[:2])


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot; idle and iowait are not busy."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return total - fields[3] - fields[4], total


CPU_SECONDS: dict[int, float] = {}  # pid -> its CPU time when last sampled


def sample(started: float, keep: int, with_pss: bool) -> Sample:
    now = Sample(time.monotonic() - started, 0, 0)
    for pid in descendants(os.getpid(), keep):
        seconds = cpu_seconds_of(pid)
        if seconds is not None:
            CPU_SECONDS[pid] = seconds
        rss = rss_of(pid)
        if rss is None:
            continue
        pss = pss_of(pid) if with_pss else 0
        now.rss += rss
        now.pss += pss
        now.processes.append((pid, rss, pss, command_line(pid)))
    return now


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples (1)")
    parser.add_argument("--report", type=Path, help="also write the summary to this file")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run (after --)")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("peak_memory: PR_SET_CHILD_SUBREAPER failed; orphans are not counted", file=sys.stderr)

    started = time.monotonic()
    busy_before, total_before = cpu_times()
    child = subprocess.Popen(command)
    peak_rss = peak_pss = Sample(0, 0, 0)
    lowest_available = mem_available()
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak_rss, peak_pss, lowest_available
        count = 0
        while not stop.is_set():
            count += 1
            # PSS (the costly read: the kernel walks every page table) every fifth sample, and when the cheap
            # RSS total sets a new peak.
            now = sample(started, child.pid, with_pss=count % 5 == 0)
            if not now.pss and now.rss > peak_rss.rss:
                now = sample(started, child.pid, with_pss=True)
            peak_rss = max(peak_rss, now, key=lambda s: s.rss)
            peak_pss = max(peak_pss, now, key=lambda s: s.pss)
            lowest_available = min(lowest_available, mem_available())
            stop.wait(args.interval)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # Forward Ctrl-C / termination to the command, and keep sampling until it ends.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    status = child.wait()
    stop.set()
    watcher.join()
    elapsed = time.monotonic() - started
    busy_after, total_after = cpu_times()
    busy_share = (busy_after - busy_before) / max(1, total_after - total_before)
    survivors = [(pid, command_line(pid)) for pid in descendants(os.getpid(), child.pid)]

    lines = [f"peak_memory: {' '.join(command)} exited {status} after {elapsed:.0f} s",
             f"peak PSS (what the processes took together): {peak_pss.pss / MIB:,.0f} MiB at {peak_pss.at_s:.0f} s"
             f" ({len(peak_pss.processes)} processes)",
             f"peak RSS (summed, shared pages counted in each): {peak_rss.rss / MIB:,.0f} MiB at {peak_rss.at_s:.0f} s",
             f"lowest MemAvailable on the host: {lowest_available / MIB:,.0f} MiB",
             f"host cores busy over the run: {busy_share:.0%} of {os.cpu_count()}",
             "processes at the PSS peak (PSS MiB, RSS MiB, pid, command):"]
    for pid, rss, pss, cmd in sorted(peak_pss.processes, key=lambda p: -p[2])[:25]:
        lines.append(f"  {pss / MIB:8,.0f} {rss / MIB:8,.0f} {pid:>8} {cmd}")
    by_kind: dict[str, float] = {}
    for pid, seconds in CPU_SECONDS.items():
        kind = kind_of(command_line(pid))
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds
    total_cpu = sum(by_kind.values())
    lines.append(f"CPU time of the processes sampled: {total_cpu:,.0f} s, by kind:")
    for kind, seconds in sorted(by_kind.items(), key=lambda item: -item[1])[:12]:
        lines.append(f"  {seconds:8,.0f} s {seconds / max(total_cpu, 1e-9):5.0%}  {kind}")
    if survivors:
        lines.append(f"{len(survivors)} processes outlived the command:")
        lines += [f"  {pid} {cmd}" for pid, cmd in survivors]
    text = "\n".join(lines)
    print(text, file=sys.stderr)
    if args.report:
        args.report.write_text(text + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
