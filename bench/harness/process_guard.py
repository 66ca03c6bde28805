"""Run a command so that it, and everything it starts, ends when the process that launched it ends.

    python bench/harness/process_guard.py --parent PID --pid-file FILE -- COMMAND...

Why: a test server is a tree (TorchServe: a launcher, its Java frontend, the model workers that Java forks;
``make serve``: make, a shell, then that tree). ``PR_SET_PDEATHSIG`` in the first child reaches only that
child (and fires when the *thread* that forked it ends, not the process), so when a test process is killed
(the OOM killer, a crashed xdist worker, SIGKILL) the rest of the tree would live on under pid 1. The guard
is the tree's root instead: it is started as the leader of a new process session, runs COMMAND as its child
in its own process group (so the whole tree shares that group), writes the child's pid to FILE, and watches
its parent, the process PID that launched it (sleeping on both processes' file descriptors where Linux has
them): when that is no longer its parent (it died, and the guard was
re-parented: also when that happened before the guard's first instruction ran), it sends SIGTERM to the
group, waits up to ``GRACE_S`` for the child to end, then SIGKILLs the group, itself included.

It stays out of the way otherwise: SIGTERM, SIGINT and SIGHUP sent to the group reach the child directly,
so the guard itself only notes them (a Python handler, which the child does not inherit across exec, unlike
an ignored signal), and when the child ends the guard ends with the child's status (a child killed by a
signal: the guard kills itself with the same signal). Standard library only: it starts in milliseconds and
holds a few MB.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time

GRACE_S = 10.0  # after the parent died: how long the child may take to stop on SIGTERM before SIGKILL
POLL_S = 0.2  # how often the parent is checked where the kernel has no process file descriptors


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--pid-file", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    parent = args.parent
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)  # the group's signals are the child's to act on
    child = subprocess.Popen(command)
    with open(args.pid_file + ".tmp", "w") as f:
        f.write(str(child.pid))
    os.replace(args.pid_file + ".tmp", args.pid_file)
    if not _wait_for_either(child, parent):  # the launching process is gone: end the whole group
        os.killpg(os.getpgrp(), signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(os.getpgrp(), signal.SIGKILL)  # (the guard too)
    status = child.wait()
    if status < 0:  # the same death for the guard (SIGKILL and SIGSTOP have no handler to reset)
        if -status not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status


def _wait_for_either(child: subprocess.Popen, parent: int) -> bool:
    """Sleep until the child ends (True) or the launching process does (False). With Linux's process file
    descriptors (5.3 and later) the guard sleeps in one ``poll`` until either process ends; elsewhere it checks
    every ``POLL_S``. (``Popen.wait(timeout)`` sleeps in steps of at most 50 ms: ~0.5% of a core for each guard,
    a test server's tree each, a dozen at a time in the test suite.)"""
    if os.getppid() != parent:
        return False
    try:
        watched = [os.pidfd_open(child.pid), os.pidfd_open(parent)]
    except (AttributeError, OSError):  # (no pidfd_open here, or the parent already gone: checked below)
        while True:
            try:
                child.wait(POLL_S)
                return True
            except subprocess.TimeoutExpired:
                if os.getppid() != parent:
                    return False
    try:
        if os.getppid() != parent:  # (the parent ended before its descriptor was opened: another process's pid)
            return False
        poller = select.poll()
        for fd in watched:
            poller.register(fd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll()}  # (signals: their handlers return, and poll() resumes)
        return watched[0] in ready
    finally:
        for fd in watched:
            os.close(fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
