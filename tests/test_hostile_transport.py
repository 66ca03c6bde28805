"""Hostile transport against `llm_api serve`: clients that hold the server by how they send and read.

One `llm_api serve` of this module's own, with small limits so the tests are quick (2 s deadlines, a
64 KiB body limit, a 4 KiB send buffer, 8 connections), and a Witness stream beside every test. The
tests prove, for each limit of ``llm_api.server.transport``:

* a connection that sends nothing, trickles its request head, or idles after an answer is closed at
  KEEPALIVE_TIMEOUT_S (not much later), with no answer;
* a body that trickles (Content-Length or chunked) gets 408 ``request_timeout`` in its route's error
  shape at BODY_TIMEOUT_S and the connection closes;
* oversize request lines, header fields, header counts and bodies, and malformed or conflicting framing
  (Content-Length with Transfer-Encoding, two lengths, bad chunk sizes) get a 4xx (413 in the route's
  shape for a body over MAX_REQUEST_BYTES), never a 2xx or 5xx, and the connection closes;
* a stream whose client stops reading is aborted at WRITE_TIMEOUT_S (the server's log says so) and, once
  the witness is done, every KV block is free and no request is left;
* with MAX_CONNECTIONS connections busy, a request on one more gets 503 ``too_many_connections`` with
  Retry-After, the probes still answer, and once they end a request is served; 1,000 half-open sockets from
  one address do not keep a key holder on that address from being served (``llm_api.server.connections``);

and in every test the witness streams without a stall, and a well-behaved request is served afterwards.
"""

from __future__ import annotations

import collections
import http.client
import io
import json
import socket
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.harness import hostile
from bench.soak import usage_after_one_more_request
from bench.harness.hostile import Answer, Witness, native_path, openai_path, outcome, refusal_problems

pytestmark = pytest.mark.server

DEADLINE_S = 2.0  # KEEPALIVE_TIMEOUT_S, BODY_TIMEOUT_S and WRITE_TIMEOUT_S of this module's server
SLACK_S = 2.5  # how much later than its deadline a limit may act on a loaded 2-core machine
LINGER_S = 2.0  # llm_api.server.transport.LINGER_S: how long a refused body is still read before the close
MAX_BODY = 65536
MAX_CONNECTIONS = 8
LIMITS = {"KEEPALIVE_TIMEOUT_S": str(DEADLINE_S), "BODY_TIMEOUT_S": str(DEADLINE_S),
          "WRITE_TIMEOUT_S": str(DEADLINE_S), "MAX_REQUEST_BYTES": str(MAX_BODY), "SEND_BUFFER_BYTES": "4096",
          "MAX_CONNECTIONS": str(MAX_CONNECTIONS)}


@pytest.fixture(scope="module")
def server(start_standalone):
    srv = start_standalone("hostile-transport", {"DTYPE": "float32", "MAX_NUM_SEQS": "16", **LIMITS})
    yield srv
    srv.stop()


# -------------------------------------------------------------------------------------------------------
# raw sockets


def connect(server, *, rcvbuf: int | None = None) -> socket.socket:
    url = urllib.parse.urlsplit(server.http)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect, so the window the server sees is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect((url.hostname, url.port))
    return sock


def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float | None]:
    """Everything the server sends until it closes the connection, and when it closed (seconds from now;
    None when it was still open after ``limit_s``)."""
    start = time.monotonic()
    data = b""
    while (left := limit_s - (time.monotonic() - start)) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return data, time.monotonic() - start
        if not chunk:
            return data, time.monotonic() - start
        data += chunk
    return data, None


class _Bytes:
    def __init__(self, data: bytes):
        self.data = data

    def makefile(self, *args, **kw):
        return io.BytesIO(self.data)


def parse_answer(data: bytes) -> Answer:
    """The first HTTP answer in ``data`` (http.client's own parser, which knows HTTP/1.x only: aiohttp
    answers a request line's HTTP/2.0 in kind)."""
    if data.startswith(b"HTTP/2.0 "):
        data = b"HTTP/1.1 " + data[len(b"HTTP/2.0 "):]
    resp = http.client.HTTPResponse(_Bytes(data))  # type: ignore[arg-type]
    resp.begin()
    try:
        body = resp.read()
    except http.client.IncompleteRead as partial:
        body = partial.partial
    return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, body)


def head(server, method: str, path: str, headers: dict[str, str], *, key: bool = True) -> bytes:
    url = urllib.parse.urlsplit(server.http)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {url.hostname}:{url.port}"]
    if key:
        lines.append(f"Authorization: Bearer {server.key()}")
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def assert_serves(server) -> None:
    answer = hostile.post_json(server, native_path(server), {"text": "Hello", "max_new_tokens": 4,
                                                              "stream": False})
    assert answer.status == 200 and answer.body.endswith(hostile.MARKER.encode()), (answer.status, answer.body[:300])


# -------------------------------------------------------------------------------------------------------
# the request head and idle connections: KEEPALIVE_TIMEOUT_S


def _silent(server) -> tuple[bytes, float | None]:
    with connect(server) as sock:
        return read_until_closed(sock, DEADLINE_S + SLACK_S + 5)


def _trickled_head(server) -> tuple[bytes, float | None]:
    """A request head sent a byte every 0.2 s, never finished (slowloris)."""
    data = head(server, "POST", native_path(server), {"Content-Type": "application/json"})[:-2] + b"X-Pad: "
    start = time.monotonic()
    with connect(server) as sock:
        for i in range(10_000):
            try:
                sock.sendall(data[i:i + 1] if i < len(data) else b"a")
            except OSError:
                break
            sock.settimeout(0.2)
            try:
                if not sock.recv(65536):
                    break
            except TimeoutError:
                continue
            except OSError:
                break
            return b"answered", time.monotonic() - start  # (nothing should be said to an unfinished head)
        return b"", time.monotonic() - start


def _idle_after_answer(server) -> tuple[bytes, float | None]:
    with connect(server) as sock:
        sock.sendall(head(server, "GET", "/health", {}))
        sock.settimeout(30)
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        return read_until_closed(sock, DEADLINE_S + SLACK_S + 5)


def test_silent_trickling_and_idle_connections_are_closed_at_the_head_deadline(server):
    cases = {"silent connection": _silent, "trickled request head": _trickled_head,
             "idle keep-alive after an answer": _idle_after_answer}
    with Witness(server) as witness:
        with ThreadPoolExecutor(len(cases)) as pool:
            futures = {name: pool.submit(case, server) for name, case in cases.items()}
            results = {name: future.result() for name, future in futures.items()}
    problems, answers = [], collections.Counter()
    for name, (data, closed_after) in results.items():
        if closed_after is None:
            problems.append(f"{name}: still open after {DEADLINE_S + SLACK_S + 5} s")
        elif not DEADLINE_S - 0.5 < closed_after < DEADLINE_S + SLACK_S:
            problems.append(f"{name}: closed after {closed_after:.2f} s (deadline {DEADLINE_S} s)")
        if data:
            problems.append(f"{name}: the server answered {data[:200]!r}")
        answers["closed" if closed_after is not None and not data else "other"] += 1
    hostile.report("transport: slow or idle request head", server, inputs=len(cases), answers=dict(answers),
                   witness=witness, limit="KEEPALIVE_TIMEOUT_S",
                   closed_after_s={name: round(r[1], 2) if r[1] else None for name, r in results.items()})
    assert not problems, problems
    assert_serves(server)


# -------------------------------------------------------------------------------------------------------
# slow bodies: BODY_TIMEOUT_S


def _trickled_body(server, path: str, chunked: bool) -> tuple[Answer | None, float, float | None]:
    """A body that would take minutes: a byte (or a one-byte chunk) every 0.2 s."""
    framing = {"Transfer-Encoding": "chunked"} if chunked else {"Content-Length": "1000"}
    start = time.monotonic()
    with connect(server) as sock:
        sock.sendall(head(server, "POST", path, {"Content-Type": "application/json", **framing}))
        data = b""
        for _ in range(200):
            try:
                sock.sendall(b"1\r\n \r\n" if chunked else b" ")
            except OSError:
                break
            sock.settimeout(0.2)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            data += chunk
            if not chunk or b"\r\n\r\n" in data:
                break
        answered_after = time.monotonic() - start
        rest, closed_after = read_until_closed(sock, LINGER_S + SLACK_S)
    return (parse_answer(data + rest) if data else None), answered_after, closed_after


def test_trickled_bodies_get_408_at_the_body_deadline(server):
    cases = [(route, path, chunked) for route, path in (("native", native_path(server)),
                                                         ("openai", openai_path(server, "chat/completions")))
             for chunked in (False, True)]
    with Witness(server) as witness:
        with ThreadPoolExecutor(len(cases)) as pool:
            results = list(pool.map(lambda case: _trickled_body(server, case[1], case[2]), cases))
    problems, answers = [], collections.Counter()
    for (route, _, chunked), (answer, answered_after, closed_after) in zip(cases, results):
        name = f"{route} {'chunked' if chunked else 'Content-Length'} body"
        if answer is None:
            problems.append(f"{name}: no answer after {answered_after:.2f} s")
            answers["none"] += 1
            continue
        answers[outcome(answer)] += 1
        problems += refusal_problems(name, answer, openai=route == "openai", statuses=(408,))
        if hostile.error_type(answer) != "request_timeout":
            problems.append(f"{name}: {answer.body[:200]!r}")
        if not DEADLINE_S - 0.5 < answered_after < DEADLINE_S + SLACK_S:
            problems.append(f"{name}: answered after {answered_after:.2f} s (deadline {DEADLINE_S} s)")
        if closed_after is None:
            problems.append(f"{name}: the connection stayed open after the 408")
    hostile.report("transport: slow body", server, inputs=len(cases), answers=dict(answers), witness=witness,
                   limit="BODY_TIMEOUT_S", answered_after_s=[round(r[1], 2) for r in results])
    assert not problems, problems
    assert_serves(server)


# -------------------------------------------------------------------------------------------------------
# sizes and framing


def framing_cases(server) -> dict[str, tuple[bytes, range | tuple]]:
    """name -> (the raw request, the statuses it may get). The route's own 413 (a JSON error) where the
    route is reached; the parser's 400/413/414/431 (plain text) before."""
    path = native_path(server)
    json_type = {"Content-Type": "application/json"}
    small = b'{"text": "Hi", "max_new_tokens": 1, "stream": false}'
    big = b'{"text": "' + b"a" * (MAX_BODY + 10) + b'"}'
    parser = (400, 413, 414, 431)
    return {
        "request line of 9000 bytes": (head(server, "GET", "/v1/models?" + "a" * 9000, {}), parser),
        "header field of 9000 bytes": (head(server, "GET", "/v1/models", {"X-Big": "a" * 9000}), parser),
        "200 header fields": (head(server, "GET", "/v1/models", {f"X-H{i}": "a" for i in range(200)}), parser),
        "body over MAX_REQUEST_BYTES": (head(server, "POST", path, {**json_type, "Content-Length": str(len(big))})
                                        + big, (413,)),
        "Content-Length over MAX_REQUEST_BYTES, body never sent": (
            head(server, "POST", path, {**json_type, "Content-Length": "10000000"}), (413,)),
        "chunked body over MAX_REQUEST_BYTES": (
            head(server, "POST", path, {**json_type, "Transfer-Encoding": "chunked"})
            + b"".join(b"%x\r\n%s\r\n" % (8192, b"a" * 8192) for _ in range(MAX_BODY // 8192 + 2)) + b"0\r\n\r\n",
            (413,)),
        "Content-Length with Transfer-Encoding: chunked": (
            head(server, "POST", path, {**json_type, "Content-Length": str(len(small)),
                                        "Transfer-Encoding": "chunked"}) + b"%x\r\n%s\r\n0\r\n\r\n" % (len(small), small),
            parser),
        "two different Content-Lengths": (
            head(server, "POST", path, json_type)[:-2] + b"Content-Length: 5\r\nContent-Length: %d\r\n\r\n" % len(small)
            + small, parser),
        "negative Content-Length": (head(server, "POST", path, {**json_type, "Content-Length": "-1"}) + small, parser),
        "Content-Length not a number": (head(server, "POST", path, {**json_type, "Content-Length": "1e3"}) + small,
                                        parser),
        "chunk size not hex": (head(server, "POST", path, {**json_type, "Transfer-Encoding": "chunked"})
                               + b"zz\r\n" + small + b"\r\n0\r\n\r\n", parser),
        "Transfer-Encoding gzip, chunked": (  # (legal framing: aiohttp passes the body on as sent)
            head(server, "POST", path, {**json_type, "Transfer-Encoding": "gzip, chunked"})
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(small), small), parser + (200, 415, 501)),
        "Transfer-Encoding: chunked twice": (
            head(server, "POST", path, json_type)[:-2] + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n"
            b"\r\n" + b"%x\r\n%s\r\n0\r\n\r\n" % (len(small), small), parser),
        "header folded over two lines": (head(server, "GET", "/v1/models", {})[:-2] + b"X-Fold: a\r\n b\r\n\r\n", parser),
        "NUL in a header": (head(server, "GET", "/v1/models", {"X-Nul": "a\x00b"}), parser),
        "space before the colon": (head(server, "GET", "/v1/models", {})[:-2] + b"X-Sp : a\r\n\r\n", parser),
        "bare LF line ends": (head(server, "GET", "/v1/models", {}).replace(b"\r\n", b"\n"), parser + (200,)),
        "HTTP/2.0 in the request line": (  # (aiohttp reads it as HTTP/1 framing: a request with the key)
            head(server, "GET", "/v1/models", {}).replace(b"HTTP/1.1", b"HTTP/2.0", 1), parser + (200, 505)),
        # markup and the end-of-stream marker in what the parser refuses: never echoed back
        "markup and the marker in a bad request line": (
            b"GET /<script>alert(1)</script><|endoftext|> HTTP/1.1 <script>\r\nHost: x\r\n\r\n", parser),
        "markup and the marker in a bad header": (
            head(server, "GET", "/v1/models", {})[:-2] + b"X-<script><|endoftext|>: a\r\n\r\n", parser + (200,)),
    }


def test_oversize_and_malformed_framing_get_4xx_and_a_closed_connection(server):
    cases = framing_cases(server)
    problems, answers = [], collections.Counter()
    with Witness(server) as witness:
        for name, (raw, statuses) in cases.items():
            with connect(server) as sock:
                try:
                    sock.sendall(raw)
                except OSError:
                    pass  # (the server may close before a large request is all sent; its answer is read below)
                data, closed_after = read_until_closed(sock, 30)
            if not data:
                problems.append(f"{name}: no answer")
                answers["no answer"] += 1
                continue
            answer = parse_answer(data)
            answers[outcome(answer)] += 1
            if answer.status == 200 and answer.status in statuses:
                continue  # (tolerated framing, a well-formed request otherwise, with a key)
            if answer.status not in statuses:
                problems.append(f"{name}: HTTP {answer.status} {answer.body[:200]!r}")
            if answer.status == 413:  # reached the route: its own error shape
                problems += refusal_problems(name, answer, openai=False, statuses=(413,))
            elif answer.status != 200:  # the transport's own page: a fixed JSON object, nothing of the request
                try:
                    page = json.loads(answer.body)
                except ValueError:
                    page = None
                if not (isinstance(page, dict) and set(page) == {"code", "type", "message"}
                        and page["code"] == answer.status):
                    problems.append(f"{name}: not the fixed error object: {answer.body[:200]!r}")
                if b"<" in answer.body or b"endoftext" in answer.body:
                    problems.append(f"{name}: request bytes echoed: {answer.body[:200]!r}")
            if closed_after is None:
                problems.append(f"{name}: the connection stayed open after HTTP {answer.status}")
    hostile.report("transport: oversize and malformed framing", server, inputs=len(cases), answers=dict(answers),
                   witness=witness, limit="aiohttp parser limits (8190-byte lines and fields, 128 fields), "
                                          "MAX_REQUEST_BYTES")
    assert not problems, problems
    assert_serves(server)


# -------------------------------------------------------------------------------------------------------
# a client that stops reading: WRITE_TIMEOUT_S


def test_a_stream_nobody_reads_is_aborted_and_its_blocks_freed(server):
    # 20 alternatives per token: about a kilobyte per engine step, so the 4 KiB send buffers (the
    # kernel's and the transport's) and the client's small window fill within some 20 steps.
    payload = json.dumps({"text": "Once upon a time", "n": 1, "logprobs": 20, "output": "jsonl",
                          "max_new_tokens": 2000, "ignore_eos": True}).encode()
    with Witness(server) as witness:
        start = time.monotonic()
        with connect(server, rcvbuf=4096) as sock:
            sock.sendall(head(server, "POST", native_path(server),
                              {"Content-Type": "application/json", "Content-Length": str(len(payload))}) + payload)
            first = b""
            while b"\r\n\r\n" not in first:
                first += sock.recv(1024)  # the head, to learn the request id; then never another read
            assert first.startswith(b"HTTP/1.1 200"), first[:300]
            request_id = parse_answer(first.split(b"\r\n\r\n")[0] + b"\r\n\r\n").headers["x-request-id"]
            lines = server.wait_for_log_lines(f"request {request_id}: the client read nothing", timeout=120)
            aborted_after = time.monotonic() - start
    assert lines, "the server did not abort the stream nobody read"
    free, total, live = usage_after_one_more_request(server)
    hostile.report("transport: a stream nobody reads", server, inputs=1, answers={"aborted": 1}, witness=witness,
                   limit="WRITE_TIMEOUT_S", aborted_after_s=round(aborted_after, 2), kv_free=f"{free}/{total}")
    assert free == total and live == 0, (free, total, live)


# -------------------------------------------------------------------------------------------------------
# many connections: MAX_CONNECTIONS


def _stream_held(server) -> socket.socket:
    """A connection busy with a long authenticated stream that nobody reads (until the socket is closed)."""
    sock = connect(server)
    body = json.dumps({"text": "Once upon a time", "max_new_tokens": 1000, "ignore_eos": True}).encode()
    sock.sendall(head(server, "POST", native_path(server), {"Content-Type": "application/json",
                                                            "Content-Length": str(len(body))}) + body)
    sock.settimeout(30)
    assert sock.recv(64).startswith(b"HTTP/1.1 200"), "the held stream did not start"
    return sock


def test_busy_connections_beyond_the_cap_get_503_and_the_probes_still_answer(server):
    """With MAX_CONNECTIONS connections each busy with a request (the witness and held streams), nothing can
    give way: a request on one more gets 503 ``too_many_connections``; the probes still answer; once the
    streams end, requests are served."""
    with Witness(server) as witness:
        held = [_stream_held(server) for _ in range(MAX_CONNECTIONS - 1)]
        try:
            answer_over = hostile.raw_request(server, "GET", openai_path(server, "models"))
            health = hostile.raw_request(server, "GET", "/health", key=None)
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.5)
        answer_after = hostile.raw_request(server, "GET", openai_path(server, "models"))
    problems = refusal_problems("over the cap", answer_over, openai=True, statuses=(503,))
    if hostile.error_type(answer_over) != "too_many_connections":
        problems.append(f"over the cap: {answer_over.body[:200]!r}")
    if answer_over.headers.get("connection", "").lower() != "close":
        problems.append(f"over the cap: the connection is kept: {answer_over.headers}")
    if health.status != 200:
        problems.append(f"/health over the cap: {health.status}")
    if answer_after.status != 200:
        problems.append(f"after the streams ended: {answer_after.status} {answer_after.body[:200]!r}")
    hostile.report("transport: many busy connections", server, inputs=len(held) + 1,
                   answers={outcome(answer_over): 1, f"probe {health.status}": 1,
                            f"after {answer_after.status}": 1},
                   witness=witness, limit="MAX_CONNECTIONS")
    assert not problems, problems
    assert_serves(server)


def test_a_thousand_half_open_sockets_do_not_lock_out_a_key_holder(server):
    """1,000 sockets from one address, each sending half a request line and holding it (reopened when the
    server closes them), far beyond MAX_CONNECTIONS, MAX_UNTRUSTED_CONNECTIONS and MAX_CONNECTIONS_PER_CLIENT:
    a key holder on the same address gets every one of its requests served, and the witness streams on."""
    import threading

    stop = threading.Event()
    opened = collections.Counter()

    def attack():
        url = urllib.parse.urlsplit(server.http)
        socks: list[socket.socket] = []
        while not stop.is_set():
            socks = [s for s in socks if s.fileno() != -1]
            while len(socks) < 1000 and not stop.is_set():
                try:
                    sock = socket.create_connection((url.hostname, url.port), timeout=5)
                    sock.sendall(b"GET /v1/mod")
                except OSError:
                    opened["refused"] += 1
                    break
                socks.append(sock)
                opened["opened"] += 1
            stop.wait(0.2)
            for sock in list(socks):  # those the server closed: open them again next round
                try:
                    sock.setblocking(False)
                    if sock.recv(1) == b"":
                        sock.close()
                except BlockingIOError:
                    pass
                except OSError:
                    sock.close()
        for sock in socks:
            sock.close()

    with Witness(server) as witness:
        attacker = threading.Thread(target=attack, daemon=True)
        attacker.start()
        try:
            while opened["opened"] < 1000 and attacker.is_alive():
                time.sleep(0.05)
            answers = [hostile.raw_request(server, "GET", openai_path(server, "models")) for _ in range(20)]
        finally:
            stop.set()
            attacker.join(30)
    statuses = collections.Counter(a.status for a in answers)
    hostile.report("transport: 1,000 half-open sockets", server, inputs=opened["opened"],
                   answers={f"key holder {status}": n for status, n in statuses.items()}, witness=witness,
                   limit="MAX_UNTRUSTED_CONNECTIONS, MAX_CONNECTIONS_PER_CLIENT")
    assert opened["opened"] >= 1000, opened
    assert statuses == {200: 20}, [(a.status, a.body[:200]) for a in answers if a.status != 200]
    assert_serves(server)
