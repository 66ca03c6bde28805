"""Who owns a stored response: one function for every edge.

A stored response (llm_api.protocols.responses.store) is readable only by whoever created it, and "whoever"
is the credential the request carried. ``owner_of`` turns an Authorization header into an owner: the
SHA-256 hex of the header's text (surrounding spaces dropped; an absent header is the empty text), so the
store never holds a key, a key never reaches a log through an owner, and different keys are different
owners. The standalone server's BearerAuth.owner applies it to the matched key's canonical header
(``Bearer <key>``); TorchServe's edge applies it to the header as received (one inference key, or auth off
behind a gateway: then everyone sending the same header, or none, is one owner).

One identity per request: the owner is derived once, at the edge, from the credential auth checked, and
travels in the route's ``Call`` (``Call.owner``); no route reads the header again. A request that sends
``Authorization`` more than once is refused (``single_authorization``: 400 ``duplicate_authorization``):
an edge that checks the first header and a table of headers that keeps the last would otherwise name two
different owners for it. Under TorchServe, whose frontend checks the header and hands the handler a table
of headers (one value per name), ``torchserve_owner`` refuses a request whose header is not the frontend's
current inference key: it passed the frontend's check with another header than the one the handler sees.

The key may also come in ``x-api-key`` (Anthropic's header: the ``anthropic`` SDK and Claude Code send
it): ``request_credential`` reads it as ``Authorization: Bearer <key>`` (the same owner, the same check)
when the request carries no ``Authorization``; an ``Authorization`` header always wins. TorchServe's
frontend checks ``Authorization`` only, so behind it the key must come in that header.
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

from llm_api.errors import ApiError


def single_authorization(values: Sequence[str]) -> str | None:
    """The request's Authorization header (None when it sent none); 400 when it sent more than one."""
    if len(values) > 1:
        raise ApiError(400, "duplicate_authorization", f"the request carries {len(values)} Authorization headers; "
                       "send exactly one")
    return values[0] if values else None


def request_credential(authorizations: Sequence[str], api_keys: Sequence[str]) -> str | None:
    """The credential a request carries, as an Authorization header's text: its ``Authorization`` header,
    else its ``x-api-key`` as ``Bearer <key>``, else None (400 for either header sent more than once)."""
    authorization = single_authorization(authorizations)
    if authorization is not None:
        return authorization
    if len(api_keys) > 1:
        raise ApiError(400, "duplicate_authorization", f"the request carries {len(api_keys)} x-api-key headers; "
                       "send exactly one")
    return f"Bearer {api_keys[0].strip()}" if api_keys else None


MISSING_KEY = "missing or wrong key (header 'Authorization: Bearer <key>' or 'x-api-key: <key>')"


def torchserve_owner(authorization: str | None, inference_key: str | None) -> str:
    """The owner of a request that TorchServe's frontend let through. ``inference_key``: the frontend's current
    key (None: token authorization is off, and the header as received names the owner, as behind a gateway)."""
    if inference_key is None or authorization is None:  # (with a key, the frontend refuses a request without one)
        return owner_of(authorization)
    expected = f"Bearer {inference_key}"
    if (authorization or "").strip() != expected:
        raise ApiError(400, "duplicate_authorization", "the Authorization header this request carries is not the "
                       "one TorchServe checked (a request may carry only one)")
    return owner_of(expected)


def owner_of(authorization: str | None) -> str:
    text = (authorization or "").strip()
    # surrogatepass: a header decoded by a lenient parser may hold lone surrogates; it still gets an owner.
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def priority_grants(key_priorities: Mapping[str, int]) -> dict[str, int]:
    """LLM_API_KEY's ``priority=N`` options (``Settings.api_key_priorities``: key -> N) by owner (``owner_of``
    of the key's header, as ``BearerAuth.owner`` names it), for the scheduler (``SchedulerConfig.priority_grants``):
    the engine sees owners, never keys."""
    return {owner_of(f"Bearer {key}"): grant for key, grant in key_priorities.items()}
