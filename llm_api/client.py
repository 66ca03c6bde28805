"""Clients for a running llm_api TorchServe: HTTP (sync and aiohttp) and gRPC, streaming and unary.

Every streaming call yields text deltas and stops at the end-of-stream marker, which it does not
yield. A stream that ends without the marker, or with an error object, raises ``StreamError``; a
refused request raises ``RequestRefused`` carrying the server's ``{"code", "type", "message"}``.
Chunks are decoded incrementally, so a UTF-8 character split across network chunks is never garbled.

Authorization: TorchServe writes its keys to ``key_file.json`` in the directory it was started from;
``read_key()`` reads one (the inference key by default).

TLS (``llm_api serve`` with ``SSL_CERTFILE``): give the clients a ``ClientTLS`` -- the CA that signed the
server's certificate (None: the system's CAs), and for a server with ``SSL_CA_CERTS`` (mutual TLS) this
client's certificate and key -- and an ``https://`` base URL; ``GRPCClient`` then opens a secure channel
(without one it speaks plaintext, which a TLS port refuses).

A request with ``"output": "jsonl"`` (needed for ``n`` > 1 and ``logprobs``) streams JSON lines:
``json_lines(client.stream(payload))`` yields them as dicts, and raises ``StreamError`` on an error line.
"""

from __future__ import annotations

import codecs
import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterator, Mapping

DEFAULT_MARKER = "<|endoftext|>"


class RequestRefused(Exception):
    def __init__(self, status: int, body: bytes | str):
        self.status = status
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        try:
            self.error = json.loads(text)
        except json.JSONDecodeError:
            self.error = {"code": status, "type": "http_error", "message": text}
        super().__init__(f"{status}: {self.error.get('message', text)}")


class StreamError(Exception):
    """The stream ended without the end-of-stream marker."""


@dataclass(frozen=True)
class ClientTLS:
    """How a client checks the server and, for mutual TLS, shows itself: PEM files."""

    ca_certs: str | Path | None = None  # the CA of the server's certificate; None: the system's CAs
    certfile: str | Path | None = None  # this client's certificate (mutual TLS), with keyfile
    keyfile: str | Path | None = None

    def ssl_context(self) -> ssl.SSLContext:
        """For HTTPS (urllib, aiohttp, httpx's ``verify=``): the server's certificate and host name checked."""
        context = ssl.create_default_context(cafile=str(self.ca_certs) if self.ca_certs else None)
        if self.certfile:
            context.load_cert_chain(str(self.certfile), str(self.keyfile) if self.keyfile else None)
        return context

    def grpc_credentials(self):
        """For ``grpc.secure_channel``: the same files, read now."""
        import grpc

        def read(path: str | Path | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        # (no keyfile: the key is kept in the certificate's file, as ssl's load_cert_chain allows too)
        key = read(self.keyfile or self.certfile) if self.certfile else None
        return grpc.ssl_channel_credentials(root_certificates=read(self.ca_certs), private_key=key,
                                            certificate_chain=read(self.certfile))


def read_key(key_file: str | Path = "key_file.json", kind: str = "inference") -> str:
    return json.loads(Path(key_file).read_text())[kind]["key"]


class _MarkerScanner:
    """Bytes in -> text out, holding back anything that may be the start of the marker."""

    def __init__(self, marker: str):
        self.marker = marker
        self.done = False
        self.text = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._pending = ""

    def feed(self, data: bytes) -> str:
        buf = self._pending + self._decoder.decode(data)
        at = buf.find(self.marker)
        if at >= 0:
            self.done = True
            self._pending = ""
            out = buf[:at]
        else:
            hold = next((n for n in range(min(len(self.marker) - 1, len(buf)), 0, -1) if buf.endswith(self.marker[:n])), 0)
            out, self._pending = buf[: len(buf) - hold], buf[len(buf) - hold :]
        self.text += out
        return out

    def close(self) -> None:
        if self.done:
            return
        tail = self._pending + self._decoder.decode(b"", final=True)
        whole = (self.text + tail).strip()
        # gRPC carries a refused request as an ordinary message holding the error object.
        if whole.startswith("{"):
            try:
                error = json.loads(whole)
            except json.JSONDecodeError:
                error = None
            if isinstance(error, dict) and "code" in error:
                raise RequestRefused(int(error["code"]), whole)
        raise StreamError(f"stream ended without the end-of-stream marker: {whole[-300:]!r}")


def json_lines(chunks) -> Iterator[dict]:
    """Text chunks of an ``"output": "jsonl"`` answer (any client's ``stream``) -> one dict per line."""
    buffer = ""
    for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split("\n")
        for line in lines:
            if line.strip():
                yield _json_line(line)
    if buffer.strip():
        yield _json_line(buffer)


def _json_line(line: str) -> dict:
    obj = json.loads(line)
    if "code" in obj and "type" in obj and "message" in obj:  # an error after the stream began
        raise StreamError(f"the request failed: {obj['message']}")
    return obj


def _headers(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


class HTTPClient:
    """Blocking HTTP client (standard library only)."""

    def __init__(self, base_url: str, model: str, key: str | None = None, marker: str = DEFAULT_MARKER, timeout: float = 600,
                 tls: ClientTLS | None = None):
        self.url = f"{base_url.rstrip('/')}/predictions/{model}"
        self.key = key
        self.marker = marker
        self.timeout = timeout
        self._context = tls.ssl_context() if tls is not None else None  # (None: urllib's default for https)

    def stream(self, payload: Mapping, chunk_size: int = 64) -> Iterator[str]:
        req = urllib.request.Request(
            self.url,
            data=json.dumps(payload).encode("utf-8"),
            headers={"Content-Type": "application/json", **_headers(self.key)},
        )
        try:
            resp = urllib.request.urlopen(req, timeout=self.timeout, context=self._context)
        except urllib.error.HTTPError as err:
            raise RequestRefused(err.code, err.read()) from None
        scanner = _MarkerScanner(self.marker)
        with resp:
            while not scanner.done:
                data = resp.read1(chunk_size) if hasattr(resp, "read1") else resp.read(chunk_size)
                if not data:
                    break
                text = scanner.feed(data)
                if text:
                    yield text
        scanner.close()

    def generate(self, payload: Mapping) -> str:
        return "".join(self.stream(payload))

    def cancel(self, request_id: str) -> bool:
        """Cancel a running request by its ``request_id`` or ``x-request-id`` (async worker mode)."""
        req = urllib.request.Request(
            self.url,
            data=json.dumps({"cancel": request_id}).encode("utf-8"),
            headers={"Content-Type": "application/json", **_headers(self.key)},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=self._context) as resp:
                return bool(json.loads(resp.read())["cancelled"])
        except urllib.error.HTTPError as err:
            raise RequestRefused(err.code, err.read()) from None


class AsyncHTTPClient:
    """aiohttp client; pass an existing ``aiohttp.ClientSession`` or let it open one per call."""

    def __init__(self, base_url: str, model: str, key: str | None = None, marker: str = DEFAULT_MARKER, session=None,
                 tls: ClientTLS | None = None):
        self.url = f"{base_url.rstrip('/')}/predictions/{model}"
        self.key = key
        self.marker = marker
        self.session = session
        self._ssl: ssl.SSLContext | bool = tls.ssl_context() if tls is not None else True  # (True: aiohttp's default)

    async def stream(self, payload: Mapping, chunk_size: int = 32) -> AsyncIterator[str]:
        import aiohttp

        session = self.session or aiohttp.ClientSession()
        try:
            async with session.post(self.url, json=dict(payload), headers=_headers(self.key), ssl=self._ssl) as resp:
                if resp.status != 200:
                    raise RequestRefused(resp.status, await resp.read())
                scanner = _MarkerScanner(self.marker)
                while not scanner.done:
                    data = await resp.content.read(chunk_size)
                    if not data:
                        break
                    text = scanner.feed(data)
                    if text:
                        yield text
                scanner.close()
        finally:
            if self.session is None:
                await session.close()

    async def generate(self, payload: Mapping) -> str:
        return "".join([t async for t in self.stream(payload)])


class GRPCClient:
    """gRPC client for TorchServe's InferenceAPIsService (streaming needs ``stream=true``); ``tls``: a secure
    channel (``llm_api serve`` with ``SSL_CERTFILE``), else plaintext."""

    def __init__(self, target: str, model: str, key: str | None = None, marker: str = DEFAULT_MARKER, timeout: float = 600,
                 tls: ClientTLS | None = None):
        import grpc

        from llm_api.proto import inference_pb2, inference_pb2_grpc

        self._pb2 = inference_pb2
        self._channel = (grpc.insecure_channel(target) if tls is None
                         else grpc.secure_channel(target, tls.grpc_credentials()))
        self._stub = inference_pb2_grpc.InferenceAPIsServiceStub(self._channel)
        self.model = model
        self.marker = marker
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {key}"),) if key else ()

    def _request(self, inputs: Mapping, stream: bool):
        fields = {k: (v if isinstance(v, bytes) else str(v).encode("utf-8")) for k, v in inputs.items()}
        if stream:
            fields["stream"] = b"true"
        # the generated protobuf module declares its messages at run time (no stubs are generated)
        return self._pb2.PredictionsRequest(model_name=self.model, input=fields)  # type: ignore[attr-defined]

    def stream(self, inputs: Mapping) -> Iterator[str]:
        """Yield text deltas. ``inputs`` are form-style fields: text/messages/params as strings."""
        scanner = _MarkerScanner(self.marker)
        responses = self._stub.StreamPredictions(self._request(inputs, True), metadata=self._metadata, timeout=self.timeout)
        for i, response in enumerate(responses):
            if i == 0 and response.prediction.startswith(b'{"code"') and self.marker.encode() not in response.prediction:
                scanner.feed(response.prediction)
                scanner.close()  # raises RequestRefused with the server's error object
            text = scanner.feed(response.prediction)
            if text:
                yield text
            if scanner.done:
                break
        scanner.close()

    def generate(self, inputs: Mapping) -> str:
        """Unary Predictions: the whole answer in one message."""
        response = self._stub.Predictions(self._request(inputs, False), metadata=self._metadata, timeout=self.timeout)
        scanner = _MarkerScanner(self.marker)
        text = scanner.feed(response.prediction)
        scanner.close()
        return text

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
