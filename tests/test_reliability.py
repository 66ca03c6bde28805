"""Reliability under load and faults, against a real TorchServe in the shipped async mode.

* load: 32 client threads keep streams in flight for 20 s (LLM_API_LOAD_SECONDS) with mixed prompts and
  parameters;
  every request ends with exactly one marker or a clear error, none outlives its deadline, greedy
  answers equal each prompt's solo answer (no mixing between requests), and afterwards every KV
  block is free and no request is left in the service's tables;
  (against TorchServe and against `llm_api serve`; a flood beyond the admission limits:
  tests/test_reliability_flood.py)
* killing the worker with streams in flight ends each stream, TorchServe starts a new worker, and
  the next request succeeds.

float32, so that a greedy answer does not depend on which other requests share its steps. The load
itself is bench/soak.py's (run that file for a longer soak).
"""

import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from bench.soak import MARKER, PROMPTS, post, run_load, usage_after_one_more_request
from bench.harness.torchserve_server import REPO

pytestmark = pytest.mark.server
# 20 s: every kind of request in the mix still runs many times over (272 requests in 30 s against TorchServe
# on a 2-core host) and the invariants are checked on each; longer only lengthened the suite's most CPU-bound
# test (it runs against both front ends) for no case it did not already cover. Longer soaks: bench/soak.py
# (docs/reliability.md has a 3-minute one).
LOAD_SECONDS = float(os.environ.get("LLM_API_LOAD_SECONDS", "20"))


def start(start_server, name, env):
    config = (REPO / "model-config.yaml").read_text()
    return start_server(name, config, env={"DTYPE": "float32", **env})


@pytest.fixture(scope="module")
def torchserve_reliable(start_server):
    srv = start(start_server, "reliable", {})
    yield srv
    srv.stop()


@pytest.fixture(params=["torchserve", "standalone"])
def reliable_front_end(request):
    """TorchServe in the shipped async mode (its own), or the session's `llm_api serve` (also float32; the
    standalone case runs in that server's group: tests/conftest.py, FRONT_END_SERVERS)."""
    return request.getfixturevalue("torchserve_reliable" if request.param == "torchserve" else "standalone_server")


def test_load_without_loss(reliable_front_end):
    server = reliable_front_end
    report = run_load(server, LOAD_SECONDS, clients=32)
    print(f"load: {report.requests} requests in {LOAD_SECONDS:.0f} s, {report.completed} completed")
    assert not report.problems, "\n".join(report.problems[:10])
    assert report.requests >= 64 and report.completed >= 32
    free, total, live = usage_after_one_more_request(server)
    assert free == total and live == 0


def test_worker_kill_ends_streams_and_recovers(torchserve_reliable):
    server = torchserve_reliable
    results, lock = [], threading.Lock()

    def one(i):
        try:
            # TorchServe 0.12's async mode does not fail the streams of a worker that died (its
            # AsyncWorkerThread has no request in hand then): they end by the client's read timeout.
            out = post(server, {"text": PROMPTS[i], "max_new_tokens": 400, "ignore_eos": True}, timeout=30)
        except Exception as exc:  # a dropped connection is a clear end too
            out = (None, repr(exc), 0.0)
        with lock:
            results.append(out)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(3)
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.ports['management']}/models/smollm2",
        headers={"Authorization": f"Bearer {server.key('management')}"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        pid = json.loads(resp.read())[0]["workers"][0]["pid"]
    os.kill(pid, signal.SIGKILL)  # the worker of the TorchServe this test started
    t0 = time.monotonic()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a stream hung after the worker died"
    assert time.monotonic() - t0 < 90
    assert all(status != 200 or not body.endswith(MARKER) for status, body, _ in results)
    # TorchServe 0.12 restarts the worker, but in async mode its management API keeps reporting the
    # new worker as not READY (AsyncWorkerThread never marks a reloaded worker loaded), and a request
    # that reaches it while it loads kills it again (docs/reliability.md). So wait for the new worker's
    # own "ready" line, then check with a request that it serves.
    assert len(server.wait_for_log_lines("LLMHandler ready", count=2, timeout=240)) >= 2, server.tail()
    recovered_at = time.monotonic() + 240
    status, body = None, ""
    while time.monotonic() < recovered_at:
        try:
            status, body, _ = post(server, {"text": "The capital of France is", "max_new_tokens": 8}, timeout=60)
        except OSError:
            status = None
        if status == 200 and body.endswith(MARKER):
            break
        time.sleep(2)
    assert status == 200 and body.endswith(MARKER), (status, body[-300:])
