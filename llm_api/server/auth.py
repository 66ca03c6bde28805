"""The standalone server's bearer keys: every route but /health, /ready and /metrics needs one.

The keys are ``LLM_API_KEY`` (one or more, comma-separated, checked by the settings) or, when that is
unset, a random one generated at start and written to the key file the server names in its log (mode
0600, replacing an older file), so a user on the machine can read it and nobody else.
``BearerAuth.allows`` compares with every key in constant time. ``BearerAuth.owner`` names who sent an
allowed header for the response store: ``owner_of`` of the key's canonical header, so two keys are two
owners and the same key is the same owner under TorchServe too. No key is ever logged or stored.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path
from typing import Sequence

from llm_api.model.setting_values import split_api_keys
from llm_api.service.owners import owner_of

KEY_BYTES = 32


class BearerAuth:
    """``keys``: None (auth off), LLM_API_KEY's text (one key, or several separated by commas: a generated
    key has no comma), or the keys themselves."""

    def __init__(self, keys: str | Sequence[str] | None):
        self.enabled = keys is not None
        if keys is None:
            keys = ()
        elif isinstance(keys, str):
            keys = split_api_keys(keys)
        if self.enabled and not keys:
            raise ValueError("BearerAuth needs at least one key (None turns auth off)")
        self._expected = tuple(f"Bearer {key}".encode() for key in keys)
        # Hashed once here, so a request's owner costs no hashing and the keys are not kept twice in the clear.
        self._owners = tuple(owner_of(header.decode()) for header in self._expected)

    def allows(self, authorization: str | None) -> bool:
        return self.owner(authorization) is not None

    def owner(self, authorization: str | None) -> str | None:
        """Who sent ``authorization``: the owner of the key it carries (a SHA-256 hex, see
        llm_api.service.owners), or None when it is not allowed. With auth off, ``owner_of`` of the header as
        received, as TorchServe's edge does. Every key is compared, each in constant time, so the time taken
        does not say which key matched or how much of one did."""
        if not self.enabled:
            return owner_of(authorization)
        if authorization is None:
            return None
        try:
            given = authorization.strip().encode("ascii")
        except UnicodeEncodeError:
            return None
        matched = None
        for expected, owner in zip(self._expected, self._owners):
            if hmac.compare_digest(given, expected):
                matched = owner
        return matched


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
