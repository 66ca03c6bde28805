"""A test run ends, and leaves nothing behind, whatever happens to the processes it started.

* A pytest-xdist worker that dies (here: SIGKILL, as the OOM killer sends it) fails its own tests at once,
  the others skip what is left, and the run ends within a minute naming the worker and the signal
  (tests/run_control.py), in a nested run with the flags ``scripts/test.sh`` uses.
* A server started by a process that is then SIGKILLed ends with every process it started (TorchServe's
  launcher, its Java frontend and model worker; ``llm_api serve``): bench/harness/process_guard.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

NESTED_CONFTEST = f"""
import sys, tempfile
from pathlib import Path
sys.path.insert(0, {str(TESTS)!r})
import run_control

def pytest_configure(config):
    run_control.register(config, Path(tempfile.mkdtemp()) / "stopped")
"""

NESTED_TESTS = """
import os, signal, time
import pytest

@pytest.mark.xdist_group("doomed")
@pytest.mark.parametrize("i", range(4))
def test_doomed(i):
    time.sleep(1)
    if i == 1:
        with open(os.environ["DEATH_FILE"], "w") as f:  # when it died, for the outer test's clock
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

@pytest.mark.xdist_group("slow")
@pytest.mark.parametrize("i", range(40))
def test_slow(i):
    time.sleep(2)  # 80 s in all: the run ends well before, once the other worker died
"""


def test_a_dead_worker_fails_its_tests_and_ends_the_run(tmp_path):
    (tmp_path / "conftest.py").write_text(NESTED_CONFTEST)
    (tmp_path / "test_nested.py").write_text(NESTED_TESTS)
    death_file = tmp_path / "died"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                          "--no-loadscope-reorder", "--max-worker-restart", "0", "-q", "-rfs", "test_nested.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={**env, "DEATH_FILE": str(death_file)})
    ended = time.time()
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    # From the worker's death to the end of the run: the nested run's own start-up (two workers loading
    # every plugin of this venv) is not what this bounds, and took 20 s of a 64 s run on a loaded 2-core host.
    after_death = ended - float(death_file.read_text())
    assert after_death < 60, f"the run took {after_death:.0f} s after a worker died:\n{out}"
    assert "died" in out and "killed by SIGKILL" in out, out
    for i in (1, 2, 3):  # the one that was running, and those queued behind it on the same worker
        assert f"FAILED test_nested.py::test_doomed[{i}]" in out, out
    assert "while running this test" in out, out
    assert "not run: worker gw" in out, out  # the other worker's remaining tests are skipped, saying why


STARTER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from bench.harness.{module} import {cls}
server = {cls}(Path({workdir!r}), env={env!r})
server.start(wait_ready=False)
print(server.proc.pid, flush=True)
time.sleep(3600)
"""


def _group(pgid: int) -> list[tuple[int, str]]:
    """(pid, command) of the live processes in process group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append((int(entry), command))
    return found


@pytest.mark.server
@pytest.mark.parametrize("kind", ["torchserve", "standalone"])
def test_a_server_ends_with_the_process_that_started_it(tmp_path, embedded_model_path, kind):
    module, cls, worker = {"torchserve": ("torchserve_server", "TorchServe", "model_service_worker"),
                           "standalone": ("standalone_server", "StandaloneServer", "llm_api.server serve")}[kind]
    env = {"MODEL_PATH": str(embedded_model_path), "DTYPE": "bfloat16", "KV_CACHE_MEMORY_MIB": "16"}
    script = textwrap.dedent(STARTER).format(root=str(TESTS.parent), module=module, cls=cls, workdir=str(tmp_path / "srv"),
                                             env=env)
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    group = None
    try:
        assert starter.stdout is not None
        group = int(starter.stdout.readline())
        deadline = time.monotonic() + 180
        while not any(worker in command and "process_guard" not in command for _, command in _group(group)):
            assert time.monotonic() < deadline, f"no {worker} process after 180 s: {_group(group)}"
            assert starter.poll() is None, "the starter exited"
            time.sleep(0.5)
        starter.kill()  # SIGKILL: nothing of the starter runs after this
        starter.wait(10)
        deadline = time.monotonic() + 30
        while _group(group):
            assert time.monotonic() < deadline, f"still alive 30 s after their starter was killed: {_group(group)}"
            time.sleep(0.5)
    finally:
        if starter.poll() is None:
            starter.kill()
        if group is not None and _group(group):  # (the test failed: end what it started)
            os.killpg(group, signal.SIGKILL)
