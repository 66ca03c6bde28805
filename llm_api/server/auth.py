"""The standalone server's bearer key: every route but /health, /ready and /metrics needs it.

The key is ``LLM_API_KEY`` (checked by the settings) or, when that is unset, a random one generated at
start and written to the key file the server names in its log (mode 0600, replacing an older file), so
a user on the machine can read it and nobody else. ``BearerAuth.allows`` compares in constant time.
The key itself is never logged.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

KEY_BYTES = 32


class BearerAuth:
    def __init__(self, key: str | None):
        self.enabled = key is not None
        self._expected = f"Bearer {key}".encode() if key is not None else b""

    def allows(self, authorization: str | None) -> bool:
        if not self.enabled:
            return True
        if authorization is None:
            return False
        try:
            given = authorization.strip().encode("ascii")
        except UnicodeEncodeError:
            return False
        return hmac.compare_digest(given, self._expected)


def resolve_key(configured: str, key_file: Path) -> tuple[str, Path | None]:
    """The key to require, and the file it was written to (None when it came from LLM_API_KEY)."""
    if configured:
        return configured, None
    key = secrets.token_urlsafe(KEY_BYTES)
    key_file = key_file.resolve()
    key_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # (an existing file keeps its mode through O_CREAT)
        os.write(fd, (key + "\n").encode())
    finally:
        os.close(fd)
    return key, key_file


def read_key_file(path: str | Path) -> str:
    return Path(path).read_text().strip()
