"""What the hostile-input suites (``tests/test_hostile_*.py``) share: a witness stream, raw requests, the
checks every refusal must pass, and a report of what each class of input got.

Every class of hostile input is sent to a running front end (TorchServe or ``llm_api serve``) while a
``Witness`` streams beside it, and must get its own answer: a 4xx in its route's error shape (or a 503
with ``Retry-After`` where a shared resource is full), never a 5xx, never a dead worker, never a stall of
the witness. The suites say what they sent and what came back with ``report()``; with
``LLM_API_HOSTILE_REPORT=<file>`` set, each report is appended to that file as a JSON line
(docs/reliability.md's table of classes is written from such a run).

``STALL_LIMIT_S`` is the largest gap between two chunks of the witness that a test accepts. The target is
1 s, and a serial run of these modules on a quiet 2-core host meets it (docs/reliability.md, "Hostile input,
by class", has the gaps of such a run; ``LLM_API_STALL_LIMIT_S=1`` makes it the bound). In the suite the
bound is looser, since other tests share the two cores: 2.5 s when the suite runs serially, 12 s beside other
pytest-xdist workers (three workers on two cores stretch an engine step to seconds: on an Intel Xeon the
witness saw 4.1 s beside the suite where the same test alone saw 0.5 s; on a 2-core AMD EPYC with avx2 only,
9.0 and 9.4 s in two CI runs where the same test alone sees 0.75-1.3 s, and the first of those included the
grammar compiler's one-time build, which the shared servers now do before their tests). Either still fails on
what the witness is there to catch, a request that holds the event loop or the engine thread for many
seconds (a 400-deep schema compiled for 15.8 s), or a dead engine.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from .server_process import ServerProcess

MARKER = "<|endoftext|>"
STALL_LIMIT_S = float(os.environ.get("LLM_API_STALL_LIMIT_S")
                      or (12.0 if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else 2.5))
NATIVE_SHAPE = frozenset({"code", "type", "message"})


# -------------------------------------------------------------------------------------------------------
# raw requests


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict  # lower-cased names
    body: bytes

    def json(self):
        return json.loads(self.body)


def raw_request(server, method: str, path: str, body: bytes | None = None, *, key: str | None = "server",
                content_type: str = "application/json", headers: dict | None = None, timeout: float = 120) -> Answer:
    """One request with exactly these bytes (``path`` as sent: no normalisation). ``key="server"``: the
    server's inference key; None: no Authorization header; any other string: that key."""
    url = urllib.parse.urlsplit(server.http)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    sent = {"Content-Type": content_type} if body is not None else {}
    if key is not None:
        sent["Authorization"] = f"Bearer {server.key() if key == 'server' else key}"
    sent.update(headers or {})
    try:
        conn.request(method, path, body=body, headers=sent)
        resp = conn.getresponse()
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def post_json(server, path: str, payload, **kw) -> Answer:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode("utf-8", "surrogatepass")
    return raw_request(server, "POST", path, data, **kw)


def native_path(server) -> str:
    return f"/predictions/{server.model_name}"


def openai_path(server, route: str) -> str:
    """``route``: "chat/completions", "completions", "models" -> that route's path on this front end."""
    return urllib.parse.urlsplit(server.openai_base).path + "/" + route


def tokenizer_path(server, route: str) -> str:
    """``route``: "tokenize" or "detokenize" (TorchServe: below the model; standalone: at the root)."""
    return urllib.parse.urlsplit(server.openai_base).path.removesuffix("/v1") + "/" + route


# -------------------------------------------------------------------------------------------------------
# what every refusal must be


def refusal_problems(name: str, answer: Answer, *, openai: bool, statuses=range(400, 500),
                     anthropic: bool = False) -> list[str]:
    """Why ``answer`` is not a proper refusal (empty when it is): a status in ``statuses``, the route's
    error shape (OpenAI's ``{"error": {message, type, param, code}}``, the native ``{code, type,
    message}``, or with ``anthropic`` Anthropic's ``{"type": "error", "error": {type, message}}``), no
    end-of-stream marker, a bounded size, no header made from request data, and
    ``Retry-After`` on a 503."""
    problems = []
    if answer.status not in statuses:
        problems.append(f"{name}: HTTP {answer.status} {answer.body[:300]!r}")
    if any("\r" in v or "\n" in v for v in answer.headers.values()) or any("evil" in k for k in answer.headers):
        problems.append(f"{name}: a header was made from request data: {answer.headers}")
    if answer.status < 400:
        return problems
    if MARKER.encode() in answer.body:
        problems.append(f"{name}: the refusal holds the end-of-stream marker")
    if len(answer.body) > 65536:
        problems.append(f"{name}: a {len(answer.body)}-byte refusal")
    if answer.status == 503 and "retry-after" not in answer.headers:
        problems.append(f"{name}: 503 without Retry-After")
    try:
        error = json.loads(answer.body)
        if anthropic:
            ok = error["type"] == "error" and {"type", "message"} <= set(error["error"])
        elif openai:
            ok = set(error) == {"error"} and {"message", "type", "param", "code"} <= set(error["error"])
        else:
            ok = set(error) == NATIVE_SHAPE and error["code"] == answer.status
    except (ValueError, TypeError):
        ok = False
    if not ok:
        shape = "Anthropic" if anthropic else "OpenAI" if openai else "native"
        problems.append(f"{name}: {answer.status} without the {shape} error shape: "
                        f"{answer.body[:300]!r}")
    return problems


def openai_param(answer: Answer):
    """The ``param`` an OpenAI-shaped refusal names ("<no error object>" when it is not one)."""
    try:
        return answer.json()["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return "<no error object>"


def openai_answer_problems(label: str, answer: Answer, elapsed: float, status: int, param,
                           max_seconds: float) -> list[str]:
    """``status`` 200: served; else a refusal in OpenAI's shape with that status naming ``param`` (None: no
    field; "*": any); and answered within ``max_seconds``."""
    if status == 200:
        problems = [] if answer.status == 200 else [f"{label}: {answer.status} {answer.body[:300]!r}"]
    else:
        problems = refusal_problems(label, answer, openai=True, statuses=(status,))
        if not problems and param != "*" and openai_param(answer) != param:
            problems.append(f"{label}: the {status} names {openai_param(answer)!r}, not {param!r}: "
                            f"{answer.body[:300]!r}")
    if elapsed > max_seconds:
        problems.append(f"{label}: answered after {elapsed:.1f} s")
    return problems


def error_type(answer: Answer) -> str | None:
    """The error's stable name in either shape: the native ``type``, OpenAI's ``code`` (its ``type`` is only
    ``invalid_request_error`` or ``server_error``); None when the body is not an error object."""
    try:
        error = json.loads(answer.body)
    except ValueError:
        return None
    if isinstance(error, dict) and isinstance(error.get("error"), dict):
        return error["error"].get("code")
    return error.get("type") if isinstance(error, dict) else None


# -------------------------------------------------------------------------------------------------------
# the witness


@dataclass
class Witness:
    """A well-behaved stream beside the hostile requests. ``with Witness(server) as w:`` starts a long
    sampled stream (temperature 1, a fixed seed: a greedy one turns repetitive, and a server with n-gram
    speculation then accepts several drafted tokens a step and runs through its tokens sooner; the block
    must end before the stream does, or the cancel below fails) and waits for its first chunk; on leaving,
    the stream is cancelled by its ``x-request-id`` and must then end with its ``cancelled`` error line (so
    it streamed the whole time, and the engine still served its cancel). ``max_gap`` is the largest gap
    between two of its chunks while the block ran, the one from its last chunk to the cancel included; the
    worker (TorchServe) or the server process (standalone) must be the same one afterwards."""

    server: ServerProcess
    max_new_tokens: int = 1000  # fits the 64 MiB KV pool of the shared async server
    max_gap: float = 0.0
    chunks: int = 0
    _conn: http.client.HTTPConnection | None = None
    _resp: http.client.HTTPResponse | None = None
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _tail: bytes = b""
    _pid: int | None = None
    _error: BaseException | None = None
    _last_chunk_at: float = 0.0  # monotonic time of the latest chunk (a stall right before the cancel counts)

    def __enter__(self) -> "Witness":
        self._pid = self.server.worker_pid()
        url = urllib.parse.urlsplit(self.server.http)
        self._conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=300)
        body = json.dumps({"text": "Once upon a time, in a quiet village by the sea,",
                           "max_new_tokens": self.max_new_tokens, "ignore_eos": True, "temperature": 1.0, "seed": 7})
        self._conn.request("POST", native_path(self.server), body=body,
                           headers={"Authorization": f"Bearer {self.server.key()}", "Content-Type": "application/json"})
        self._resp = self._conn.getresponse()
        assert self._resp.status == 200, (self._resp.status, self._resp.read()[:300])
        self._tail = self._resp.read1(65536)  # the first chunk: the witness is generating
        self._last_chunk_at = time.monotonic()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._resp is not None
        last = self._last_chunk_at
        try:
            while not self._stop.is_set():
                data = self._resp.read1(65536)
                now = time.monotonic()
                if not data:
                    return
                self.max_gap = max(self.max_gap, now - last)
                last = self._last_chunk_at = now
                self.chunks += 1
                self._tail = (self._tail + data)[-4096:]
            # after the cancel: the rest of the stream, not timed
            while data := self._resp.read1(65536):
                self._tail = (self._tail + data)[-4096:]
        except BaseException as exc:  # reported by __exit__
            self._error = exc

    def __exit__(self, *exc_info) -> None:
        assert self._resp is not None and self._thread is not None and self._conn is not None
        request_id = self._resp.headers["x-request-id"]
        # The gap still open when the block ends counts too (a stall just before the cancel).
        gap_before_cancel = max(self.max_gap, time.monotonic() - self._last_chunk_at)
        self._stop.set()
        cancelled = post_json(self.server, native_path(self.server), {"cancel": request_id})
        self._thread.join(60)
        self._conn.close()
        self.max_gap = gap_before_cancel
        if exc_info[0] is not None:
            return
        assert self._error is None, f"the witness stream failed: {self._error!r}"
        assert not self._thread.is_alive(), "the witness stream did not end after its cancel"
        assert cancelled.status == 200 and cancelled.json() == {"cancelled": True}, \
            f"the witness had already ended: {cancelled.body!r}; its tail: {self._tail[-300:]!r}"
        last_line = self._tail.decode("utf-8", "replace").strip().splitlines()[-1]
        assert json.loads(last_line)["type"] == "cancelled", last_line
        assert self.max_gap < STALL_LIMIT_S, f"the witness stalled for {self.max_gap:.2f} s"
        assert self.server.worker_pid() == self._pid, "the worker (or the server) is not the same process"


# -------------------------------------------------------------------------------------------------------
# the report


def report(kind: str, server, *, inputs: int, answers: dict, witness: Witness | None = None, **extra) -> None:
    """Record what a class of hostile input got: ``answers`` maps an outcome ("400 invalid_grammar",
    "503 overloaded", "200") to how many inputs got it."""
    line = {"class": kind, "front_end": server.kind, "inputs": inputs, "answers": dict(sorted(answers.items())),
            "witness_max_gap_s": round(witness.max_gap, 3) if witness else None,
            "witness_chunks": witness.chunks if witness else None, **extra}
    path = os.environ.get("LLM_API_HOSTILE_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(line) + "\n")
    print(json.dumps(line))


def outcome(answer: Answer) -> str:
    """"<status> <error type>" for a refusal, "<status>" otherwise: the key ``report`` counts by."""
    kind = error_type(answer) if answer.status >= 400 else None
    return f"{answer.status} {kind}" if kind else str(answer.status)
