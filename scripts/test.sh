#!/usr/bin/env bash
# Set up (with test tools) and run the whole test suite. Extra arguments go to pytest.
#
# The suite runs in LLM_API_TEST_WORKERS parallel pytest-xdist workers (default 3; 0 runs it serially, in one
# process). Most of its time is spent waiting on servers it started, so three workers keep a 2-core host
# busy. Each test belongs to one group (tests/conftest.py: the shared server it uses, else its module) and
# a group runs on one worker, so no server is started twice and nothing runs beside itself that must not.
# --max-worker-restart 0: a worker that dies (the OOM killer, a segfault) fails its own tests at once and the
# run stops within a minute instead of hanging (tests/run_control.py); no replacement worker is started.
#
# OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads otherwise spin while waiting for work, and with the
# workers, the servers' model workers and in-process engines all running torch on 2 cores the spinning
# threads take the cores from the ones with work: three processes each running small matrix products ran
# 4-8 times slower than with passive waiting (measured on the 2-core EPYC, flags avx2, 2026-11-25). A
# single serving process on its own cores is better off spinning, which is why the servers' default is left
# alone outside the tests.
#
# OMP_NUM_THREADS=1: one torch and OpenMP thread a process. The suite is many processes (three workers, the
# servers they start, the Ray replicas) on 2 cores, all busy (99% of both cores, sampled every 5 s through a
# run), so a process's second thread adds no core, only the cost of handing it work: a sleeping (passive)
# thread is woken by a futex for each parallel region, and the embedded model's regions are microseconds long.
# Measured on the 2-core Intel Xeon (amx_int8, avx512_vnni), 2026-11-29: `llm_api serve` on the embedded
# GGUF, 18 greedy chats of up to 64 tokens, used 15.0-16.0 s of CPU with two passive threads against 8.6-9.9
# with one (and 13.7-14.4 s of wall time against 8.6-9.8, on a quiet host); tests/engine/test_bf16.py and
# test_parity.py in-process 70 CPU seconds against 57. The kernel tests set two threads themselves
# (tests/kernels/conftest.py: the products' and attention's splitting across threads is what they check).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
. scripts/env.sh
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
workers="${LLM_API_TEST_WORKERS:-3}"
if [ "$workers" = "0" ]; then
  exec python -m pytest "$@"
fi
# --durations=25: the slowest tests in every run's log (CI's too), which is what the suite's time budget is
# managed by (LONG_GROUPS_FIRST in tests/conftest.py).
xdist=(-n "$workers" --dist loadgroup --no-loadscope-reorder --max-worker-restart 0 --durations=25)
if [ "$#" -gt 0 ]; then
  exec python -m pytest "${xdist[@]}" "$@"
fi
# The whole suite: the Ray Serve tests (tests/test_scale_out.py) run after the rest, alone. They start a local
# Ray cluster, whose raylet gives up when its node agent (a Python process) has not started within its own
# deadline, and beside three busy workers on 2 cores it had not: the node failed to start in two CI runs
# (2026-11-27, Intel Xeon 2-core), while the same tests pass beside a lighter load. On a quiet host they take
# 2-3 minutes.
status=0
python -m pytest "${xdist[@]}" --ignore=tests/test_scale_out.py || status=$?
python -m pytest -p no:cacheprovider --durations=5 tests/test_scale_out.py || status=$((status ? status : $?))
exit "$status"
