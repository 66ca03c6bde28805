"""TLS on `llm_api serve` (SSL_KEYFILE, SSL_CERTFILE, SSL_CA_CERTS; llm_api.server.tls).

A test CA, a server certificate for 127.0.0.1 and localhost, a client certificate, and a second CA with a
client certificate of its own are made at test time (``cryptography``). One real server with mutual TLS
(key and certificate from the environment, the client CA as the ``--ssl-ca-certs`` flag) answers the real
``openai`` package over ``https://`` and streams gRPC over a secure channel to a client with the client
certificate, and refuses clients without one (HTTP and gRPC alike), a certificate from the other CA, plain
HTTP and plaintext gRPC; a connection that never starts its handshake is closed at ``HEADER_TIMEOUT_S``.
Bad files (a key of another certificate, a missing file, a CA file without a certificate, an encrypted key)
stop the command with exit 2 before anything listens, naming the file; the rest are checked without a
server.
"""

from __future__ import annotations

import asyncio
import datetime
import http.client
import ipaddress
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bench.harness.server_process import REPO, free_ports
from llm_api.client import AsyncHTTPClient, ClientTLS, GRPCClient, HTTPClient
from llm_api.model.settings import ConfigError, Settings, readme_table
from llm_api.server.tls import load_server_tls

pytestmark = pytest.mark.server

HANDSHAKE_S = 2.0  # the server's HEADER_TIMEOUT_S, which bounds a TLS handshake too
SLACK_S = 2.5  # how much later than its deadline a limit may act on a loaded 2-core machine


# ---------------------------------------------------------------------------------------------------
# the test PKI


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # a client certificate from another CA
    stranger_key: Path
    other_key: Path  # a key of no certificate here
    encrypted_key: Path  # the server's key under a password


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())  # (milliseconds, where RSA takes a while)


def _key_pem(key, password: bytes | None = None) -> bytes:
    encryption = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


def _certificate(subject: str, key, issuer: str, issuer_key, *, ca: bool = False, names: list | None = None) -> bytes:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def make_pki(folder: Path) -> Pki:
    ca_key, stranger_ca_key = _key(), _key()
    server_key, client_key, stranger_key, other_key = _key(), _key(), _key(), _key()
    files = {
        "ca.pem": _certificate("llm_api test CA", ca_key, "llm_api test CA", ca_key, ca=True),
        "server.pem": _certificate("llm_api test server", server_key, "llm_api test CA", ca_key,
                                   names=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
        "server.key": _key_pem(server_key),
        "client.pem": _certificate("llm_api test client", client_key, "llm_api test CA", ca_key),
        "client.key": _key_pem(client_key),
        "stranger.pem": _certificate("stranger", stranger_key, "another CA", stranger_ca_key),
        "stranger.key": _key_pem(stranger_key),
        "other.key": _key_pem(other_key),
        "encrypted.key": _key_pem(server_key, b"a password"),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return Pki(*(folder / name for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key",
                                            "stranger.pem", "stranger.key", "other.key", "encrypted.key")))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def server(start_standalone, pki):
    """Mutual TLS: key and certificate from the environment, the client CA as a flag (both ways of giving a
    setting that has a flag). A small KV pool: the requests here are a few tokens."""
    srv = start_standalone("tls", {"SSL_KEYFILE": str(pki.server_key), "SSL_CERTFILE": str(pki.server_cert),
                                   "KV_CACHE_MEMORY_MIB": "64", "HEADER_TIMEOUT_S": str(HANDSHAKE_S)},
                           args=["--ssl-ca-certs", str(pki.ca)],
                           tls=ClientTLS(pki.ca, pki.client_cert, pki.client_key))
    yield srv
    srv.stop()


def with_client_certificate(pki: Pki) -> ClientTLS:
    return ClientTLS(pki.ca, pki.client_cert, pki.client_key)


# ---------------------------------------------------------------------------------------------------
# the server


def test_the_openai_package_is_answered_over_https(server, pki):
    assert server.openai_base.startswith("https://127.0.0.1:")
    with httpx.Client(verify=with_client_certificate(pki).ssl_context()) as http:
        client = openai.OpenAI(base_url=server.openai_base, api_key=server.key(), http_client=http, max_retries=0)
        messages = [{"role": "user", "content": "Say hello."}]
        answer = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=8)
        assert answer.choices[0].message.content
        stream = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=8, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "llm_api serve: ready" in server.tail() and f"HTTP https://127.0.0.1:{server.ports['http']}" in server.tail()


def test_the_package_clients_speak_https(server, pki):
    tls = with_client_certificate(pki)
    payload = {"text": "The capital of France is", "max_new_tokens": 4}
    assert HTTPClient(server.http, server.model_name, key=server.key(), tls=tls).generate(payload)
    text = asyncio.run(AsyncHTTPClient(server.http, server.model_name, key=server.key(), tls=tls).generate(payload))
    assert text
    assert "llm_" in server.metrics_text()  # (the harness's probes over TLS too)


def test_grpc_streams_over_a_secure_channel(server, pki):
    with GRPCClient(server.grpc, server.model_name, key=server.key(), tls=with_client_certificate(pki)) as client:
        pieces = list(client.stream({"text": "The capital of France is", "max_new_tokens": "8"}))
    assert len(pieces) >= 2 and "".join(pieces), pieces  # (token by token, not one message)


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate"])
def test_a_client_without_a_certificate_of_the_ca_is_refused(server, pki, who):
    tls = ClientTLS(pki.ca) if who == "no certificate" else ClientTLS(pki.ca, pki.stranger_cert, pki.stranger_key)
    headers = {"Authorization": f"Bearer {server.key()}"}
    with httpx.Client(verify=tls.ssl_context()) as http, pytest.raises(httpx.TransportError):
        # (TLS 1.3: the client's handshake completes before the server checks its certificate, so the refusal
        # arrives as the server's alert, on the first read)
        http.get(f"{server.openai_base}/models", headers=headers, timeout=10)
    with GRPCClient(server.grpc, server.model_name, key=server.key(), tls=tls, timeout=10) as client:
        with pytest.raises(grpc.RpcError) as refused:
            list(client.stream({"text": "Hello", "max_new_tokens": "2"}))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plain_http_and_plaintext_grpc_get_nothing_from_the_tls_ports(server):
    with pytest.raises((OSError, http.client.HTTPException)) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{server.ports['http']}/ready", timeout=10).read()
    assert not isinstance(refused.value, urllib.error.HTTPError)  # (no HTTP answer at all, not even an error)
    with GRPCClient(server.grpc, server.model_name, key=server.key(), timeout=10) as client:
        with pytest.raises(grpc.RpcError) as grpc_refused:
            list(client.stream({"text": "Hello", "max_new_tokens": "2"}))
    assert grpc_refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_connection_that_never_starts_its_handshake_is_closed_at_the_deadline(server):
    with socket.create_connection(("127.0.0.1", server.ports["http"]), timeout=HANDSHAKE_S + SLACK_S + 5) as sock:
        started = time.monotonic()
        assert sock.recv(1) == b""  # (closed by the server, nothing sent)
        assert time.monotonic() - started < HANDSHAKE_S + SLACK_S


# ---------------------------------------------------------------------------------------------------
# bad files stop the command before it listens


@pytest.mark.parametrize("case", ["key of another certificate", "missing certificate", "CA file without a certificate",
                                  "encrypted key"])
def test_a_bad_file_stops_the_command_before_it_listens_naming_the_file(pki, tmp_path, case):
    missing = tmp_path / "nowhere" / "server.pem"
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    key, cert, ca, named = {
        "key of another certificate": (pki.other_key, pki.server_cert, None, pki.other_key),
        "missing certificate": (pki.server_key, missing, None, missing),
        "CA file without a certificate": (pki.server_key, pki.server_cert, junk, junk),
        "encrypted key": (pki.encrypted_key, pki.server_cert, None, pki.encrypted_key),
    }[case]
    port, grpc_port = free_ports(2)
    args = ["--port", str(port), "--grpc-port", str(grpc_port), "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    args += ["--ssl-ca-certs", str(ca)] if ca else []
    run = subprocess.run([sys.executable, "-m", "llm_api.server", "serve", *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)})
    assert run.returncode == 2 and str(named) in run.stderr, run.stderr
    assert "HTTP on" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr  # (one line, no listen)


def test_serve_itself_refuses_a_bad_key_before_it_listens(pki, tmp_path):
    """A caller of ``serve`` that passes no loaded TLS gets the settings' own, checked the same way."""
    from llm_api.server.server import ServeOptions, serve

    settings = Settings.from_env({"SSL_KEYFILE": str(pki.other_key), "SSL_CERTFILE": str(pki.server_cert)})
    port = free_ports(1)[0]
    options = ServeOptions(port=port, grpc_port=0, key_file=tmp_path / "llm_api.key")
    assert asyncio.run(serve(settings, options)) == 2
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


# ---------------------------------------------------------------------------------------------------
# without a server


def test_key_and_certificate_go_together_and_the_ca_needs_them():
    with pytest.raises(ConfigError, match="SSL_KEYFILE .* is set but SSL_CERTFILE"):
        Settings.from_env({"SSL_KEYFILE": "server.key"})
    with pytest.raises(ConfigError, match="SSL_CERTFILE .* is set but SSL_KEYFILE"):
        Settings.from_env({"SSL_CERTFILE": "server.pem"})
    with pytest.raises(ConfigError, match="SSL_CA_CERTS .* needs TLS"):
        Settings.from_env({"SSL_CA_CERTS": "ca.pem"})
    with pytest.raises(ConfigError, match="leading or trailing spaces"):
        Settings.from_env({"SSL_KEYFILE": " server.key", "SSL_CERTFILE": "server.pem"})
    assert load_server_tls(Settings.from_env({})) is None


def test_a_flag_wins_over_its_variable_and_the_readme_names_both(pki, monkeypatch):
    from llm_api.server import cli

    settings = Settings.from_env({"SSL_KEYFILE": "from-env.key", "SSL_CERTFILE": "from-env.pem"},
                                 flags={"SSL_KEYFILE": str(pki.server_key)})
    assert (settings.ssl_keyfile, settings.ssl_certfile) == (str(pki.server_key), "from-env.pem")
    args = cli.parser().parse_args(["serve", "--ssl-keyfile", "k", "--ssl-certfile", "c", "--ssl-ca-certs", "a"])
    assert (args.SSL_KEYFILE, args.SSL_CERTFILE, args.SSL_CA_CERTS) == ("k", "c", "a")
    table = readme_table()
    for row in ("`SSL_KEYFILE` (`--ssl-keyfile`)", "`SSL_CERTFILE` (`--ssl-certfile`)", "`SSL_CA_CERTS` (`--ssl-ca-certs`)"):
        assert row in table


def test_the_loaded_tls_holds_tls_1_2_at_least_and_asks_for_client_certificates_with_a_ca(pki):
    plain = load_server_tls(Settings.from_env({"SSL_KEYFILE": str(pki.server_key),
                                               "SSL_CERTFILE": str(pki.server_cert)}))
    assert plain is not None and not plain.mutual
    assert plain.context.minimum_version == ssl.TLSVersion.TLSv1_2 and plain.context.verify_mode == ssl.CERT_NONE
    mutual = load_server_tls(Settings.from_env({"SSL_KEYFILE": str(pki.server_key), "SSL_CERTFILE": str(pki.server_cert),
                                                "SSL_CA_CERTS": str(pki.ca)}))
    assert mutual is not None and mutual.mutual and mutual.context.verify_mode == ssl.CERT_REQUIRED
    assert mutual.keyfile.is_absolute() and mutual.grpc_credentials() is not None
    with pytest.raises(ConfigError, match="holds no CA certificate"):  # (a leaf cannot sign the clients')
        load_server_tls(Settings.from_env({"SSL_KEYFILE": str(pki.server_key), "SSL_CERTFILE": str(pki.server_cert),
                                           "SSL_CA_CERTS": str(pki.client_cert)}))
    with pytest.raises(ConfigError, match="SSL_CERTFILE=.* holds no certificate"):
        load_server_tls(Settings.from_env({"SSL_KEYFILE": str(pki.server_key), "SSL_CERTFILE": str(pki.server_key)}))


def test_ray_serves_https_from_the_files_and_refuses_mutual_tls(pki, embedded_model_path, monkeypatch, capsys):
    from llm_api.scale_out import deployments, run
    from llm_api.server import cli

    monkeypatch.setenv("MODEL_PATH", str(embedded_model_path))  # (the command checks the model before Ray starts)
    monkeypatch.delenv("LLM_API_KEY", raising=False)
    for name in ("SSL_KEYFILE", "SSL_CERTFILE", "SSL_CA_CERTS"):
        monkeypatch.delenv(name, raising=False)
    handed = []
    monkeypatch.setattr(run, "serve_on_ray", lambda *args: handed.append(args) or 0)
    # (Ray's own check of the autoscaling options imports Ray, seconds of this test for nothing of TLS: this
    # test runs beside the others, test_scale_out.py's after them)
    monkeypatch.setattr(deployments, "autoscaling_config", lambda *args: None)
    files = ["--ssl-keyfile", str(pki.server_key), "--ssl-certfile", str(pki.server_cert)]
    assert cli.main(["serve", "--ray", *files, "--ssl-ca-certs", str(pki.ca)]) == 2
    assert "SSL_CA_CERTS (--ssl-ca-certs) is not served under --ray" in capsys.readouterr().err and not handed
    assert cli.main(["serve", "--ray", "--ssl-keyfile", str(pki.other_key), "--ssl-certfile", str(pki.server_cert)]) == 2
    assert "does not match the certificate" in capsys.readouterr().err and not handed
    assert cli.main(["serve", "--ray", *files]) == 0
    settings, host, port, tls = handed[0][0], handed[0][1], handed[0][2], handed[0][-1]
    options = run.http_options(settings, host, port, tls)
    assert (options["ssl_keyfile"], options["ssl_certfile"]) == (str(pki.server_key), str(pki.server_cert))
    assert "ssl_keyfile" not in run.http_options(settings, host, port, None)
