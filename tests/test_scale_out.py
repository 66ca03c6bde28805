"""llm_api as a Ray Serve application (llm_api.scale_out; docs/scale-out.md).

The index and the routing text alone first (no Ray), then one real local Ray cluster (a head on this
machine, started by ``llm_api serve --ray --replicas 2 --max-replicas 3``) with two replicas of the embedded
model behind Ray's HTTP proxy: both replicas serve, with the key checked; a stream comes through token by
token; 20 chats sharing a 1,000-token system prompt, interleaved with unrelated ones, all land on one
replica; a conversation continues with previous_response_id whichever replica answers; an adapter's
requests go to the replica holding it; hostile bodies get their errors; load brings a third replica, and
when it falls the replica Ray removes finishes its stream first; a client leaving a stream aborts its request on
the replica (the replica's log line says so); a replica killed mid-stream ends only that
stream, with the format's error, and the next request is answered; and last, a SIGKILL of the server
leaves no Ray process behind. Which replica answered: the ``x-llm-api-replica`` header; its pid: the line
each replica logs at start. (The SIGTERM stop is what bench/scale_out.py ends with.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from llm_api.scale_out.affinity import BLOCK_CHARS, PrefixIndex, affinity_text, block_hashes

KEY = "scale-out-key-123"
REPO = Path(__file__).resolve().parents[1]
INJECT = REPO / "tests" / "assets" / "inject_failure"
INJECT_FILE = "inject-failures-now"
REPLICA_HEADER = "x-llm-api-replica"
MARKER = "<|endoftext|>"
AUTOSCALING = {"target_ongoing_requests": 2, "metrics_interval_s": 1, "look_back_period_s": 2,
               "upscale_delay_s": 1, "downscale_delay_s": 1}


# ---------------------------------------------------------------------------------------------------
# the routing text and the index


def test_a_continued_chat_starts_with_the_earlier_requests_routing_text():
    system = {"role": "system", "content": "You are terse."}
    first = affinity_text("chat", {"messages": [system, {"role": "user", "content": "Hi"}]})
    second = affinity_text("chat", {"messages": [system, {"role": "user", "content": "Hi"},
                                                 {"role": "assistant", "content": "Hello"},
                                                 {"role": "user", "content": "More"}]})
    assert second.startswith(first[:-1])  # (all but the list's closing: the messages are joined in order)
    assert affinity_text("completions", {"prompt": "abc"}) == "abc"
    assert affinity_text("generate", {"text": "abc"}) == "abc"
    assert "Be brief" in affinity_text("responses", {"instructions": "Be brief", "input": "x"})
    for route, body in (("chat", {"messages": "not a list"}), ("health", {}), ("chat", None), ("chat", [1]),
                        ("completions", {"prompt": float("nan")})):
        assert isinstance(affinity_text(route, body), str)


def test_the_index_matches_whole_shared_blocks_and_forgets():
    index = PrefixIndex(max_blocks=1000)
    shared = "x" * (10 * BLOCK_CHARS)
    index.insert(shared + "first question", "a")
    index.insert("something else entirely " * 20, "b")
    matched = index.match(shared + "second question", ["a", "b", "c"])
    assert matched == {"a": 10 * BLOCK_CHARS, "b": 0, "c": 0}
    assert index.match("y" + shared, ["a"]) == {"a": 0}  # (a prefix, not a substring)
    index.forget("a")
    assert index.match(shared, ["a"]) == {"a": 0}


def test_the_index_is_bounded_per_replica_and_a_match_stops_at_the_first_evicted_block():
    index = PrefixIndex(max_blocks=8)
    old = "".join(chr(65 + i) * BLOCK_CHARS for i in range(6))
    index.insert(old, "a")
    index.insert("".join(chr(97 + i) * BLOCK_CHARS for i in range(6)), "a")  # evicts the old text's first 4
    assert len(block_hashes(old)) == 6
    assert index.match(old, ["a"]) == {"a": 0}  # (its later blocks are held, but not its first)


@pytest.mark.parametrize("flags, refusal", [
    (["--autoscaling-config", '{"downscale_delay_s": 5}'], "needs --max-replicas"),
    (["--max-replicas", "2", "--autoscaling-config", '{"downscale_delay": 5}'],
     "downscale_delay: not a field of Ray Serve's AutoscalingConfig"),
    (["--max-replicas", "2", "--autoscaling-config", '{"min_replicas": 0}'], "set by --replicas and --max-replicas"),
    (["--max-replicas", "2", "--autoscaling-config", '{"upscale_delay_s": -1}'], "greater than or equal to 0"),
    (["--max-replicas", "2", "--autoscaling-config", "[1]"], "is not a JSON object"),
    (["--max-replicas", "2", "--autoscaling-config", "{"], "is not JSON"),
])
def test_a_bad_autoscaling_config_stops_the_command_before_a_cluster_starts(flags, refusal, capsys, monkeypatch):
    from llm_api.scale_out import run
    from llm_api.server import cli

    monkeypatch.delenv("LLM_API_KEY", raising=False)
    monkeypatch.setattr(run, "serve_on_ray", lambda *args: pytest.fail("accepted: a cluster would start"))
    with pytest.raises(SystemExit) if "JSON" in refusal else contextlib.nullcontext():
        assert cli.main(["serve", "--ray", *flags]) == 2
    assert refusal in capsys.readouterr().err


def test_the_processes_below_several_roots_are_found_at_once():
    """What the reaper kills when the server has gone includes what the noted processes started since its
    last scan (ray_processes_below with those processes as roots): here two parents, each with a child whose
    command line is a Ray worker's, and an unrelated child that is not."""
    from llm_api.scale_out.reaper import identity_of, ray_processes_below

    script = 'exec -a "ray::FakeWorker" sleep 60 & exec -a "plain" sleep 60 & wait'
    parents = [subprocess.Popen(["bash", "-c", script]) for _ in range(2)]
    try:
        deadline = time.monotonic() + 10
        while len(found := ray_processes_below(*(p.pid for p in parents))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(found) == 2 and all(identity_of(pid) == (pid, at) for pid, at in found), found
        assert len(ray_processes_below(parents[0].pid)) == 1
    finally:
        for parent in parents:
            for pid in [int(p) for p in Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()]:
                os.kill(pid, signal.SIGKILL)
            parent.kill()
            parent.wait()


def test_ray_processes_are_told_apart_by_their_command_lines():
    from llm_api.scale_out.reaper import is_ray_process

    for ray in (b"ray::DashboardAgent\0", b"ray::IDLE", b"/v/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet\0--x",
                b"/usr/bin/python3\0-u\0/usr/lib/python3/dist-packages/ray/dashboard/agent.py\0"):
        assert is_ray_process(ray), ray
    for other in (b"/v/bin/python\0-m\0llm_api.server\0serve\0--ray\0", b"java\0-cp\0ray/x", b"raylet-lookalike",
                  b"/home/ray/bin/python\0script.py", b""):
        assert not is_ray_process(other), other


# ---------------------------------------------------------------------------------------------------
# a real Ray cluster, two replicas


def _adapters(folder, embedded_model_path) -> str:
    """LORA_ADAPTERS with two small random adapters of the embedded model (the model released after)."""
    import gc

    import torch
    from lora_helpers import make_adapter
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(embedded_model_path, dtype=torch.float32)
    pairs = [f"{name}={make_adapter(model, folder / name, seed=seed, r=2, targets=['q_proj'])}"
             for name, seed in (("alpha", 31), ("beta", 32))]
    del model
    gc.collect()
    return ",".join(pairs)


@pytest.fixture(scope="module")
def ray_app(tmp_path_factory, embedded_model_path, embedded_checkpoint_path):
    from bench.harness.standalone_server import StandaloneServer

    adapters = _adapters(tmp_path_factory.mktemp("ray-adapters"), embedded_checkpoint_path)
    # 96 MiB of KV per replica: ~2,000 float32 tokens of the embedded model, room for the shared prefix;
    # one adapter slot per replica (MAX_LORAS=1), so where an adapter's requests go matters.
    # Autoscaling between 2 and 3 replicas at a target of 2 requests in flight each, quick to react (Ray's
    # metrics pushed every second, not 10; 2 s averaged; 1 s before adding or removing one): the other
    # tests send one request at a time beside at most one stream, which keeps 2. Half a CPU each, so that a
    # third fits the 2-core host's Ray node (a replica that reserves a whole CPU waits to be scheduled).
    workdir = tmp_path_factory.mktemp("ray-app")
    server = StandaloneServer(workdir, args=[
        "--ray", "--replicas", "2", "--max-replicas", "3", "--autoscaling-config", json.dumps(AUTOSCALING),
        "--cpus-per-replica", "0.5"], env={
        "MODEL_PATH": str(embedded_model_path), "LLM_API_KEY": KEY, "DTYPE": "float32", "KV_CACHE_MEMORY_MIB": "96",
        "MAX_NUM_SEQS": "8", "DRAIN_GRACE_S": "60", "LORA_ADAPTERS": adapters, "MAX_LORAS": "1",
        "KEEPALIVE_TIMEOUT_S": str(KEEPALIVE_S),
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
        "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
        # (a failure after the first chunk while the file exists: test_a_failure_mid_stream_...)
        "PYTHONPATH": f"{INJECT}:{REPO}", "LLM_API_INJECT_FAILURE": f"after-first-chunk-while:{workdir / INJECT_FILE}"})
    try:
        server.start(timeout=420)  # (Ray's own start is a minute or more on a busy 2-core host)
        yield server
    finally:
        server.stop()


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def _chat(server, messages, max_tokens=2, model=None) -> httpx.Response:
    # Greedy: OpenAI's default temperature (1) samples, and a sample may end at EOS before max_tokens.
    return httpx.post(f"{server.http}/v1/chat/completions", headers=_headers(), timeout=120, json={
        "model": model or server.model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0})


def _replica_pid(server, replica: str) -> int:
    found = re.findall(rf"llm_api replica {re.escape(replica)}: pid (\d+)", server.model_log())
    assert found, f"no start line for replica {replica}"
    return int(found[-1])


KEEPALIVE_S = 4  # (the fixture's KEEPALIVE_TIMEOUT_S: Ray's proxy takes it as its keep-alive timeout)


def test_an_idle_keep_alive_connection_is_closed_and_metrics_need_the_key(ray_app):
    """Ray's proxy closes a connection idle for KEEPALIVE_TIMEOUT_S after its answer, as `llm_api serve` does
    (its other transport guards have no option in Ray: docs/scale-out.md); /metrics answers only with the key
    (METRICS_PUBLIC unset)."""
    port = int(ray_app.http.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        answered = b""
        while b"\r\n\r\n" not in answered:
            answered += conn.recv(4096)
        assert answered.startswith(b"HTTP/1.1 200"), answered[:200]
        idle_from = time.monotonic()
        while conn.recv(4096):  # (the rest of the answer, then the close)
            pass
        idle = time.monotonic() - idle_from
    assert idle < KEEPALIVE_S + 5, f"the idle connection stayed open {idle:.1f} s"
    assert httpx.get(f"{ray_app.http}/metrics", timeout=60).status_code == 401
    assert httpx.get(f"{ray_app.http}/metrics", headers=_headers(), timeout=60).status_code == 200


def test_both_replicas_serve_behind_the_proxy_and_the_key_is_checked(ray_app):
    replicas = set()
    for index in range(12):
        answer = _chat(ray_app, [{"role": "user", "content": f"Say the number {index * 7919} twice."}])
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] is not None
        replicas.add(answer.headers[REPLICA_HEADER])
    assert len(replicas) == 2, replicas  # (unrelated prompts: the less loaded of two at random)
    refused = httpx.post(f"{ray_app.http}/v1/chat/completions", json={"model": "x", "messages": []}, timeout=30)
    assert refused.status_code == 401 and set(refused.json()["error"]) >= {"message", "type", "code"}
    twice = httpx.post(f"{ray_app.http}/v1/models", timeout=30,
                       headers=[("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer other-key-456")])
    assert twice.status_code == 400, twice.text
    assert httpx.get(f"{ray_app.http}/nowhere", headers=_headers(), timeout=30).status_code == 404


def test_a_stream_comes_through_the_proxy_token_by_token(ray_app):
    arrivals = []
    body = {"text": "Count from one to fifty:", "max_new_tokens": 40, "ignore_eos": True}
    with httpx.stream("POST", ray_app.native_url, headers=_headers(), json=body, timeout=120) as answer:
        assert answer.status_code == 200
        for piece in answer.iter_raw():
            arrivals.append((time.monotonic(), piece))
    text = b"".join(piece for _, piece in arrivals).decode()
    assert text.endswith("<|endoftext|>"), text[-200:]
    assert len(arrivals) >= 20, f"{len(arrivals)} pieces: the proxy buffered the stream"
    assert arrivals[-1][0] - arrivals[0][0] > 0.2  # (spread over the generation, not all at the end)


def test_a_shared_prefix_stays_on_one_replica_among_unrelated_requests(ray_app):
    # ~1,000 tokens of system prompt (numbered, so the tokenizer cannot fold it into a few tokens)
    system = " ".join(f"Rule {i}: answer item {i} plainly." for i in range(140))
    held_by, unrelated = [], set()
    for index in range(20):
        answer = _chat(ray_app, [{"role": "system", "content": system},
                                 {"role": "user", "content": f"Question {index}: what is {index} + {index}?"}])
        assert answer.status_code == 200, answer.text
        held_by.append(answer.headers[REPLICA_HEADER])
        other = _chat(ray_app, [{"role": "user", "content": f"Unrelated {index}: name a colour {index * 31}."}])
        assert other.status_code == 200, other.text
        unrelated.add(other.headers[REPLICA_HEADER])
    usage = json.loads(answer.text)["usage"]
    assert usage["prompt_tokens"] >= 1000, usage
    assert len(set(held_by)) == 1, held_by


def test_a_conversation_continues_with_previous_response_id_on_either_replica(ray_app):
    """The replicas share the stored responses (one SQLite file for the run): a turn whose previous
    response was stored by the other replica continues it all the same."""
    answered_by = []
    previous = None
    for turn in range(6):
        body = {"model": ray_app.model_name, "input": f"Turn {turn}: say one word.", "max_output_tokens": 3,
                **({"previous_response_id": previous} if previous else {})}
        answer = httpx.post(f"{ray_app.http}/v1/responses", headers=_headers(), json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        response = answer.json()
        assert response["status"] in ("completed", "incomplete"), response
        if previous:
            assert response["previous_response_id"] == previous
        previous = response["id"]
        answered_by.append(answer.headers[REPLICA_HEADER])
    # (which replica answers each turn is the router's choice; the last turn's prompt holds all six turns)
    assert answer.json()["usage"]["input_tokens"] > 40, answer.json()["usage"]


def test_an_adapters_requests_go_to_the_replica_holding_it(ray_app):
    """MAX_LORAS=1: each replica holds one adapter in its slot. The first request for an adapter goes to a
    replica holding the fewest (Ray's multiplexing rule), which then holds it; once that is known to the
    router (the replica reports it within a fraction of a second), every request for it goes there."""
    holder = {}
    for name in ("alpha", "beta"):
        first = _chat(ray_app, [{"role": "user", "content": f"Hello from {name}"}], model=name)
        assert first.status_code == 200, first.text
        assert first.json()["model"] == name
        holder[name] = first.headers[REPLICA_HEADER]
        time.sleep(1.5)  # (the replica's report reaches the router)
    assert holder["alpha"] != holder["beta"], holder  # (the second went to the replica holding none)
    for turn in range(4):
        for name in ("alpha", "beta", ray_app.model_name):
            answer = _chat(ray_app, [{"role": "user", "content": f"Turn {turn} for {name}"}], model=name)
            assert answer.status_code == 200, answer.text
            if name in holder:
                assert answer.headers[REPLICA_HEADER] == holder[name], (name, turn, holder)


def test_hostile_requests_through_the_ingress_get_their_errors_and_harm_no_other(ray_app):
    """What the ingress itself reads: the body's size (413, declared or streamed), its form, a request id
    the client chose (echoed by Ray's proxy only when it is a plain token), an unknown method; the
    replicas judge the rest in each route's own shape. A normal request is answered afterwards."""
    url = f"{ray_app.http}/v1/chat/completions"
    big = httpx.post(url, headers=_headers(), content=b"{" + b" " * 7_000_000 + b"}", timeout=120)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large", big.text[:300]
    chunks = (b" " * 1_000_000 for _ in range(8))  # (no Content-Length: chunked, counted as it comes)
    streamed = httpx.post(url, headers=_headers(), content=chunks, timeout=120)
    assert streamed.status_code == 413, streamed.text[:300]
    broken = httpx.post(url, headers=_headers(), content=b'{"model": "smollm2", "messages": [', timeout=60)
    assert broken.status_code == 400 and set(broken.json()["error"]) >= {"message", "type", "code"}, broken.text
    native = httpx.post(ray_app.native_url, headers=_headers(), content=b"\xff\xfe not json", timeout=60)
    assert native.status_code == 400 and set(native.json()) == {"code", "type", "message"}, native.text
    multipart = httpx.post(ray_app.native_url, headers={"Authorization": f"Bearer {KEY}"},
                           files={"text": ("a.txt", b"hello")}, timeout=60)
    assert multipart.status_code == 415, multipart.text
    odd_id = httpx.post(url, headers={**_headers(), "x-request-id": "evil id <script>"}, timeout=60,
                        json={"model": ray_app.model_name, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2})
    assert odd_id.status_code == 200, odd_id.text
    assert httpx.request("PATCH", url, headers=_headers(), timeout=60).status_code == 405
    after = _chat(ray_app, [{"role": "user", "content": "Still there?"}])
    assert after.status_code == 200, after.text


class Stream(threading.Thread):
    """One native stream read to its end in a thread (or left once ``leave`` is set): which replica
    answered, what came."""

    def __init__(self, server, text: str, tokens: int):
        super().__init__(daemon=True)
        self.server, self.body = server, {"text": text, "max_new_tokens": tokens, "ignore_eos": True}
        self.opened, self.leave = threading.Event(), threading.Event()
        self.replica, self.status, self.pieces, self.ended_at = None, None, [], None  # (ended_at: wall clock, as Ray logs)

    def run(self):
        try:
            with httpx.stream("POST", self.server.native_url, headers=_headers(), json=self.body,
                              timeout=240) as answer:
                self.status = answer.status_code
                self.replica = answer.headers.get(REPLICA_HEADER) if answer.status_code == 200 else None
                self.opened.set()
                for piece in answer.iter_raw():
                    self.pieces.append(piece)
                    if self.leave.is_set():
                        return
        finally:
            self.opened.set()
            self.ended_at = time.time()

    def text(self) -> str:
        return b"".join(self.pieces).decode(errors="replace")


def _model_replica_processes(server) -> set[int]:
    """The pids of the model replicas' processes below the server (Ray names them ``ray::ServeReplica:...``;
    a replica's own start line reaches the server's log only a while after, sometimes not before it ends)."""
    from llm_api.scale_out.reaper import ray_processes_below

    found = set()
    for pid, _ in ray_processes_below(server.server_pid()):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if title.startswith(b"ray::ServeReplica:llm_api:ModelReplica"):
            found.add(pid)
    return found


def _removals(server) -> list[float]:
    """When Ray's controller decided to remove one model replica (its log lines, wall-clock time)."""
    found = re.findall(r"INFO (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) controller \d+ -- Removing 1 replica from "
                       r"Deployment\(name='ModelReplica'", server.model_log())
    return [datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() for stamp in found]


def test_replicas_scale_up_under_load_and_a_removed_replica_finishes_its_streams(ray_app):
    """--max-replicas 3 with the fixture's AUTOSCALING: 5 streams in flight (2.5 a replica against a target of
    2) bring a third replica. Then with a stream on each of the three and the load's streams left, 3 requests
    in flight call for 2 replicas: Ray removes one while its stream runs, and that stream still ends with
    the marker (Ray's graceful shutdown, DRAIN_GRACE_S=60), as do the others; its process ends after."""
    deadline = time.monotonic() + 60
    while len(_model_replica_processes(ray_app)) != 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(_model_replica_processes(ray_app)) == 2
    removals_before = len(_removals(ray_app))
    load = [Stream(ray_app, f"Story {i}: tell a very long tale about the ship number {i * 37}.", 2000)
            for i in range(5)]
    for stream in load:
        stream.start()
    for stream in load:
        stream.opened.wait(120)
    drained: list[Stream] = []
    try:
        deadline = time.monotonic() + 240
        while len(_model_replica_processes(ray_app)) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(_model_replica_processes(ray_app)) == 3, "no third replica within 240 s of 5 streams in flight"
        old = {stream.replica for stream in load} - {None}
        while len(old | {_chat(ray_app, [{"role": "user", "content": "Ready?"}]).headers[REPLICA_HEADER]}) < 3:
            assert time.monotonic() < deadline, "the third replica answered nothing within 240 s"
            time.sleep(0.5)
        # A stream on each of the three (the router sends each to the less loaded of two)
        while len({s.replica for s in drained}) < 3 and len(drained) < 15 and time.monotonic() < deadline:
            # (long enough to outlast the removal's decision, a few seconds after the load leaves)
            # (800 tokens: 300 ended 0.2 s before Ray's decision in a CI run once the quantized model decoded
            # ~3x faster)
            stream = Stream(ray_app, f"Essay {len(drained)}: describe the harbour at dawn, street by street.", 800)
            stream.start()
            stream.opened.wait(120)
            drained.append(stream)
            time.sleep(0.5)
        replicas = {s.replica for s in drained}
        assert len(replicas) == 3 and None not in replicas, [(s.status, s.replica, s.text()[:200]) for s in drained]
    finally:
        for stream in load:
            stream.leave.set()
    # One stream a replica stays: 3 in flight, which 2 replicas serve at the target
    kept = {stream.replica: stream for stream in reversed(drained)}
    for stream in drained:
        if kept[stream.replica] is not stream:
            stream.leave.set()
    drained = list(kept.values())
    deadline = time.monotonic() + 120
    while len(_model_replica_processes(ray_app)) == 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    exited_at = time.time()
    assert len(_model_replica_processes(ray_app)) == 2, "no replica removed within 120 s of 3 requests in flight"
    for stream in drained:
        stream.join(240)
        assert stream.text().endswith(MARKER), (stream.replica, stream.text()[-300:])
    while len(_removals(ray_app)) == removals_before and time.monotonic() < deadline + 30:
        time.sleep(0.5)
    decided = _removals(ray_app)[removals_before:]
    assert len(decided) == 1, decided
    after = {_chat(ray_app, [{"role": "user", "content": f"After {i}"}]).headers[REPLICA_HEADER] for i in range(10)}
    assert len(after) == 2 and after < replicas, (after, replicas)
    removed = (replicas - after).pop()
    on_removed = [s for s in drained if s.replica == removed]
    # Ray decided the removal while the removed replica's stream ran, and the stream still got its end marker
    # (checked above): drained, not cut. (When the client read that end is no bound on the process's exit: the
    # replica may exit once it has sent it; CI saw the read 0.7 s after the exit, on a busy host.)
    assert on_removed and all(decided[0] < s.ended_at for s in on_removed), (
        decided, [s.ended_at for s in on_removed], exited_at)


def test_a_client_leaving_mid_stream_aborts_its_request_on_the_replica(ray_app):
    body = {"text": "Write a long story about a lighthouse.", "max_new_tokens": 2000, "ignore_eos": True}
    with httpx.stream("POST", ray_app.native_url, headers=_headers(), json=body, timeout=120) as answer:
        assert answer.status_code == 200
        request_id = answer.headers["x-request-id"]
        for count, _ in enumerate(answer.iter_raw(), 1):
            if count == 3:
                break  # (leaving: the connection is closed with the response)
    aborted = f"request {request_id}: the client went away; aborted"
    # (a replica's lines reach the server's log through Ray's log monitor; in one CI run this line had not
    # come within 30 s, which did not reproduce here: 90 s, to tell a slow log from a lost abort)
    deadline = time.monotonic() + 90
    while aborted not in ray_app.model_log() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert aborted in ray_app.model_log()
    after = _chat(ray_app, [{"role": "user", "content": "Still serving?"}])
    assert after.status_code == 200, after.text


def test_a_failure_mid_stream_ends_each_route_in_its_own_format(ray_app):
    """The failure tests/test_edge_failures.py injects into `llm_api serve` and TorchServe, injected into the Ray
    replicas (while the fixture's file exists): each streamed route through Ray Serve's ingress ends with its
    own in-band error, and the app serves on after it."""
    from edge_failure_checks import check_chat_and_completions, check_messages, check_native, check_responses

    still = [{"role": "user", "content": "Still serving?"}]
    before = _chat(ray_app, still, max_tokens=8)
    assert before.status_code == 200, before.text
    switch = ray_app.workdir / INJECT_FILE
    switch.touch()
    try:
        check_chat_and_completions(ray_app, KEY, ray_app.model_name)
        check_responses(ray_app, KEY, ray_app.model_name)
        check_messages(ray_app, KEY, ray_app.model_name)
        check_native(ray_app, KEY)
    finally:
        switch.unlink()
    # (the same greedy answer as before the failures, on whichever replica: no stream's end left state behind)
    after = _chat(ray_app, still, max_tokens=8)
    assert after.status_code == 200 and after.json()["choices"] == before.json()["choices"], (before.text, after.text)


# (near the end: the killed replica is replaced, and its successor loads for a while)
def test_a_replica_killed_mid_stream_ends_only_that_stream_with_an_error(ray_app):
    body = {"text": "Write a long story about a lighthouse.", "max_new_tokens": 600, "ignore_eos": True}
    pieces = []
    with httpx.stream("POST", ray_app.native_url, headers=_headers(), json=body, timeout=180) as answer:
        assert answer.status_code == 200
        replica = answer.headers[REPLICA_HEADER]
        pid = _replica_pid(ray_app, replica)
        for piece in answer.iter_raw():
            pieces.append(piece)
            if len(pieces) == 5:
                os.kill(pid, signal.SIGKILL)
    text = b"".join(pieces).decode()
    error = json.loads(text.rstrip().splitlines()[-1])  # (a native stream ends with the marker or an error line)
    assert error["code"] == 500 and error["type"] == "internal_error", error
    after = _chat(ray_app, [{"role": "user", "content": "Are you there?"}])
    assert after.status_code == 200, after.text
    assert after.headers[REPLICA_HEADER] != replica


# (last: it ends the app)
def test_a_sigkilled_server_leaves_no_ray_process_behind(ray_app):
    """SIGKILL, which no handler sees. Left to Ray, its two node agents stayed (they ignore SIGTERM too), and
    its workers (controller, proxy, replicas) too where orphans go to a subreaper, as they do in this test
    session (tests/run_control.py); the server's reaper (llm_api/scale_out/reaper.py) ends them."""
    from llm_api.scale_out.reaper import identity_of, ray_processes_below

    started = ray_processes_below(ray_app.server_pid())
    assert len(started) >= 8, started  # GCS, raylet, 2 agents, Serve's controller and proxy, ingress, 2 replicas
    os.kill(ray_app.server_pid(), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (left := [pid for pid, at in started if identity_of(pid) == (pid, at)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes still running 30 s after the server's SIGKILL: {left}"
