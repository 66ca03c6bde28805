"""A flood beyond the admission limits gets 503 at once while the accepted requests complete, against
TorchServe in the shipped async mode and against `llm_api serve`, each started with small limits of its own.

(A module of its own, apart from tests/test_reliability.py: a test process runs at most two servers at once,
bench/harness/server_process.py, and that module's servers live as long as its tests.)
"""

import json
import threading

import pytest

from bench.soak import MARKER, PROMPTS, post
from bench.harness.torchserve_server import REPO

pytestmark = pytest.mark.server


@pytest.mark.parametrize("kind", ["torchserve", "standalone"])
def test_flood_gets_503_while_accepted_requests_complete(start_server, start_standalone, kind):
    limits = {"MAX_NUM_SEQS": "2", "MAX_WAITING_REQUESTS": "2"}
    if kind == "torchserve":
        srv = start_server("flood", (REPO / "model-config.yaml").read_text(), env={"DTYPE": "float32", **limits})
    else:
        srv = start_standalone("flood-standalone", {"DTYPE": "float32", **limits})
    try:
        results = []
        lock = threading.Lock()

        def one(i):
            out = post(srv, {"text": PROMPTS[i % 8], "max_new_tokens": 48, "ignore_eos": True})
            with lock:
                results.append(out)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        accepted = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 503]
        assert len(accepted) + len(refused) == 24
        assert accepted and refused
        assert all(body.endswith(MARKER) for _, body, _ in accepted)
        assert all(json.loads(body)["type"] == "overloaded" for _, body, _ in refused)
        assert max(seconds for *_, seconds in refused) < 10
    finally:
        srv.stop()
