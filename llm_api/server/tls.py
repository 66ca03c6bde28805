"""TLS for ``llm_api serve``: the server's key, certificate and client CA, read and checked once, before a port opens.

Contract:

- ``load_server_tls(settings)`` is None without ``SSL_CERTFILE`` (plain HTTP and gRPC), else a ``ServerTLS``:
  one ``ssl.SSLContext`` (TLS 1.2 at least) for every HTTPS connection of the aiohttp site, and the same
  files' bytes for gRPC's ``ssl_server_credentials`` (``grpc_credentials``), so both ports serve the one
  certificate. With ``SSL_CA_CERTS`` the TLS is mutual on both: a client must present a certificate signed by
  one of those CAs (``CERT_REQUIRED``; gRPC's ``require_client_auth``), else its handshake fails before a
  byte of its request is read, the probes' included (a client certificate is not a bearer key: the key is
  still checked on every route but the probes).
- Everything that can be known wrong about the files is found here, as a ``ConfigError`` naming the
  variable and the path (``llm_api serve`` prints it and exits 2, before the model loads and before any
  port opens): a file that cannot be read (missing, a folder, no permission), a certificate file without a
  certificate, a key file without a private key, a key that does not belong to the certificate, a key
  protected by a password (no setting gives one: OpenSSL would otherwise ask for it on the terminal and
  the start would hang), a CA file without a CA certificate. The expiry of the certificate is not checked:
  clients refuse an expired one themselves.
- The files are read at the start only; a renewed certificate needs a restart.
- gRPC's own TLS (BoringSSL inside ``grpcio``) negotiates TLS 1.2 or 1.3, its defaults.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llm_api.model.settings import ConfigError, Settings

if TYPE_CHECKING:  # (grpc is imported where credentials are made: the --ray driver checks files only)
    import grpc

MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2


@dataclass(frozen=True)
class ServerTLS:
    context: ssl.SSLContext  # the aiohttp site's, shared by every connection
    keyfile: Path  # absolute: the --ray proxy reads the files in a process of its own
    certfile: Path
    ca_certs: Path | None  # set: mutual TLS
    key_pem: bytes
    cert_pem: bytes
    ca_pem: bytes | None

    @property
    def mutual(self) -> bool:
        return self.ca_pem is not None

    def grpc_credentials(self) -> "grpc.ServerCredentials":
        """The same key, certificate and client CA for the gRPC port."""
        import grpc

        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=self.mutual)


def load_server_tls(settings: Settings) -> ServerTLS | None:
    """The server's TLS, or None when ``SSL_CERTFILE`` is unset (the settings have checked that the key and
    certificate come together); a ``ConfigError`` naming the file for anything wrong with the files."""
    if not settings.ssl_certfile:
        return None
    keyfile, certfile = Path(settings.ssl_keyfile), Path(settings.ssl_certfile)
    ca_certs = Path(settings.ssl_ca_certs) if settings.ssl_ca_certs else None
    cert_pem = _read("SSL_CERTFILE", certfile)
    key_pem = _read("SSL_KEYFILE", keyfile)
    ca_pem = _read("SSL_CA_CERTS", ca_certs) if ca_certs is not None else None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = MINIMUM_VERSION
    # A client that renegotiates again and again has the server do handshakes for free; OpenSSL 3 refuses
    # that by default, older builds do not.
    context.options |= ssl.OP_NO_RENEGOTIATION
    _check_certificate(certfile, cert_pem)
    try:
        context.load_cert_chain(certfile, keyfile, password=_refuse_password(keyfile))
    except ssl.SSLError as err:
        # (the certificate parsed above: what fails now is the key, or the pair)
        if err.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"SSL_KEYFILE={str(keyfile)!r} does not match the certificate in SSL_CERTFILE="
                              f"{str(certfile)!r} (the key of another certificate?)") from None
        said = f"; OpenSSL: {err.reason}" if err.reason else ""
        raise ConfigError(f"SSL_KEYFILE={str(keyfile)!r} holds no private key OpenSSL can read (PEM: "
                          f"'-----BEGIN ... PRIVATE KEY-----'{said})") from None
    if ca_certs is not None:
        try:
            context.load_verify_locations(cafile=ca_certs)
        except ssl.SSLError as err:
            raise ConfigError(f"SSL_CA_CERTS={str(ca_certs)!r} holds no certificate in PEM form: {err}") from None
        if not context.cert_store_stats()["x509_ca"]:
            raise ConfigError(f"SSL_CA_CERTS={str(ca_certs)!r} holds no CA certificate (only certificates that "
                              "cannot sign others): give the CA that signed the clients' certificates")
        context.verify_mode = ssl.CERT_REQUIRED
    return ServerTLS(context, keyfile.resolve(), certfile.resolve(), ca_certs.resolve() if ca_certs else None,
                     key_pem, cert_pem, ca_pem)


def _read(variable: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{variable}={str(path)!r} cannot be read: {err.strerror or err}") from None


def _check_certificate(certfile: Path, pem: bytes) -> None:
    """A certificate file must hold a certificate: said here, because ``load_cert_chain`` answers a bad
    certificate and a bad key alike ("PEM lib")."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem.decode("ascii", "replace"))
    except ssl.SSLError:
        raise ConfigError(f"SSL_CERTFILE={str(certfile)!r} holds no certificate in PEM form "
                          "('-----BEGIN CERTIFICATE-----')") from None


def _refuse_password(keyfile: Path):
    """OpenSSL's password callback: an encrypted key is refused (without a callback OpenSSL prompts on the
    terminal, and a server started by a supervisor would wait there forever)."""

    def password() -> str:
        raise ConfigError(f"SSL_KEYFILE={str(keyfile)!r} is encrypted with a password, which llm_api serve does not "
                          f"take: decrypt it (openssl pkey -in KEY -out PLAIN_KEY) and keep the file private")

    return password
