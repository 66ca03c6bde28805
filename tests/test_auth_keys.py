"""Several bearer keys (LLM_API_KEY="k1,k2") and the owner each one stands for (BearerAuth.owner, owner_of).

Two keys are both allowed and are two owners of stored responses; the owner is the SHA-256 of the key's
canonical header, never the key; a bad entry in the list stops the settings (and ``llm_api serve``) naming
LLM_API_KEY without echoing any key. The standalone edge's middleware is checked through aiohttp's test
server (no model: the routes answer 503 loading once the key passed, 401 when it did not).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys

import pytest

from llm_api.model.settings import ConfigError, Settings
from llm_api.server.auth import BearerAuth
from llm_api.service.owners import owner_of

KEY_ONE, KEY_TWO = "first-key-0123", "second-key-4567"


def test_two_keys_are_both_allowed_and_two_owners():
    settings = Settings.from_env({"LLM_API_KEY": f"{KEY_ONE},{KEY_TWO}"})
    assert settings.api_keys == (KEY_ONE, KEY_TWO) and KEY_ONE not in repr(settings)
    for auth in (BearerAuth(settings.api_key), BearerAuth(settings.api_keys)):
        one, two = auth.owner(f"Bearer {KEY_ONE}"), auth.owner(f"  Bearer {KEY_TWO} ")
        assert one is not None and two is not None and one != two
        assert one == hashlib.sha256(f"Bearer {KEY_ONE}".encode()).hexdigest() == owner_of(f"Bearer {KEY_ONE}")
        assert KEY_ONE not in one and auth.allows(f"Bearer {KEY_TWO}")
        for refused in (None, "", KEY_ONE, f"Bearer {KEY_ONE},{KEY_TWO}", f"Bearer {KEY_ONE}x", f"bearer {KEY_ONE}",
                        "Bearer \u00e9", f"Bearer {KEY_ONE[:-1]}"):
            assert auth.owner(refused) is None and not auth.allows(refused), refused
    assert Settings.from_env({}).api_keys == ()


def test_one_key_keeps_working_as_before():
    auth = BearerAuth(KEY_ONE)
    assert auth.allows(f"Bearer {KEY_ONE}") and not auth.allows(f"Bearer {KEY_TWO}")
    assert auth.owner(f"Bearer {KEY_ONE}") == owner_of(f"Bearer {KEY_ONE}")
    with pytest.raises(ValueError):
        BearerAuth(())  # auth on with no key would refuse everyone: a bug, not a setting


def test_owner_with_auth_off_is_the_header_as_received():
    """--no-auth (a gateway in front), and TorchServe's edge: whoever sends the same header is one owner."""
    auth = BearerAuth(None)
    assert auth.allows(None) and auth.owner(None) == owner_of(None) == owner_of("") == hashlib.sha256(b"").hexdigest()
    assert auth.owner("Bearer a") == owner_of("Bearer a") != owner_of("Bearer b")
    assert owner_of("Bearer a ") == owner_of("Bearer a") and len(owner_of("\ud800")) == 64


@pytest.mark.parametrize("value", [
    f"{KEY_ONE},",  # an empty key after the comma
    f",{KEY_ONE}",
    f"{KEY_ONE},,{KEY_TWO}",
    f"{KEY_ONE} {KEY_TWO}",  # a space is no separator: the second key would be an option
    f"{KEY_ONE} priority=high",
    f"{KEY_ONE} priority=-1 priority=-2",
    f"{KEY_ONE} priority=99999999999",
    f"{KEY_ONE} priority=--1",
    f"{KEY_ONE} Priority=-1",
    f"{KEY_ONE},short",
    f"{KEY_ONE},{KEY_ONE}",  # listed twice
    f"{KEY_ONE},tab\tin-the-key",
])
def test_a_bad_key_list_names_the_variable_and_no_key(value):
    with pytest.raises(ConfigError) as err:
        Settings.from_env({"LLM_API_KEY": value})
    message = str(err.value)
    assert "LLM_API_KEY is not usable" in message and "separated by commas" in message
    assert KEY_ONE not in message and KEY_TWO not in message and "short" not in message


def test_a_keys_priority_option_names_its_owner_for_the_scheduler_and_is_no_part_of_the_key():
    from llm_api.server.auth import BearerAuth
    from llm_api.service.owners import priority_grants

    settings = Settings.from_env({"LLM_API_KEY": f"{KEY_ONE}, {KEY_TWO} priority=-10"})
    assert settings.api_keys == (KEY_ONE, KEY_TWO) and settings.api_key_priorities == {KEY_TWO: -10}
    auth = BearerAuth(settings.api_key)
    assert auth.allows(f"Bearer {KEY_ONE}") and auth.allows(f"Bearer {KEY_TWO}")
    assert not auth.allows(f"Bearer {KEY_TWO} priority=-10")
    # The engine's grants are keyed by the owner the edge names for a request with that key, and hold no key.
    grants = priority_grants(settings.api_key_priorities)
    assert grants == {auth.owner(f"Bearer {KEY_TWO}"): -10} and KEY_TWO not in repr(grants)
    assert priority_grants(Settings.from_env({"LLM_API_KEY": f"{KEY_ONE} priority=7"}).api_key_priorities) == {
        auth.owner(f"Bearer {KEY_ONE}"): 7}


def test_a_bad_key_list_stops_the_command():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "llm_api.server", "serve"], capture_output=True, text=True, timeout=60,
                         cwd=repo, env={**os.environ, "PYTHONPATH": str(repo), "LLM_API_KEY": f"{KEY_ONE},tiny"})
    assert run.returncode == 2 and "LLM_API_KEY is not usable (key 2 of 2 has 4 characters)" in run.stderr, run.stderr
    assert KEY_ONE not in run.stderr and "tiny" not in run.stderr


def test_the_standalone_edge_lets_each_key_in():
    from aiohttp.test_utils import TestClient, TestServer

    from llm_api.server.http_api import ServerState, build_app
    from llm_api.server.lifecycle import Lifecycle
    from llm_api.server.metrics import ServerMetrics

    async def statuses() -> list[int]:
        state = ServerState("<|endoftext|>", BearerAuth(f"{KEY_ONE},{KEY_TWO}"), Lifecycle(), ServerMetrics("m"),
                            1 << 20)
        async with TestClient(TestServer(build_app(state))) as client:
            seen = []
            for key in (KEY_ONE, KEY_TWO, "third-key-8901", f"{KEY_ONE},{KEY_TWO}"):
                response = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
                seen.append(response.status)
            return seen

    assert asyncio.run(statuses()) == [503, 503, 401, 401]  # in: loading (no model here); out: 401
