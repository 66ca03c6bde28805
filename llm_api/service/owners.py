"""Who owns a stored response: one function for every edge.

A stored response (llm_api.service.response_store) is readable only by whoever created it, and "whoever"
is the credential the request carried. ``owner_of`` turns an Authorization header into an owner: the
SHA-256 hex of the header's text (surrounding spaces dropped; an absent header is the empty text), so the
store never holds a key, a key never reaches a log through an owner, and different keys are different
owners. The standalone server's BearerAuth.owner applies it to the matched key's canonical header
(``Bearer <key>``); TorchServe's edge applies it to the header as received (one inference key, or auth off
behind a gateway: then everyone sending the same header, or none, is one owner).
"""

from __future__ import annotations

import hashlib


def owner_of(authorization: str | None) -> str:
    text = (authorization or "").strip()
    # surrogatepass: a header decoded by a lenient parser may hold lone surrogates; it still gets an owner.
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
