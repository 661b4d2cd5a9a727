"""The data plane's team check (`proxy.access.check_team`): a request carrying another team's
API key is answered as a sandbox that does not exist, before the sandbox is looked up (a paused
one is not even said to be paused); one carrying its own team's key goes on without the key
(the guest never sees it); a value that is no key the node knows, or none, goes on as it came.
The node's own `Tenancy` over its keys and catalog is tested in tests/api/test_teams.py, the
gateway's naming of a cluster key in tests/cluster/test_dataplane_teams.py."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from starlette.types import Scope

from aenv.proxy import SandboxProxy
from aenv.proxy.access import API_KEY_HEADER
from tests.proxy.conftest import USER_PORT
from tests.proxy.support import DictResolver, FakeSandbox, serve
from tests.support.ports import free_port

OURS, THEIRS = "e2b_" + "1" * 40, "e2b_" + "2" * 40


@dataclass
class Teams:
    """Two keys of two teams; every sandbox is team `a`'s."""

    async def caller_team(self, scope: Scope) -> str | None:
        given = next((v for n, v in scope["headers"] if n == API_KEY_HEADER), b"").decode()
        return {OURS: "a", THEIRS: "b"}.get(given)

    def sandbox_team(self, sandbox_id: str) -> str | None:
        return "a" if sandbox_id.startswith("user") else None


@pytest.fixture
def teams_proxy(resolver: DictResolver) -> Iterator[str]:
    with serve(SandboxProxy(resolver, tenancy=Teams()), free_port()) as url:
        yield url


def _routed(sandbox_id: str, **headers: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(USER_PORT), **headers}


def test_another_team_s_key_finds_no_sandbox(teams_proxy: str, sandbox_id: str) -> None:
    with httpx.Client(base_url=teams_proxy) as client:
        theirs = client.get("/echo", headers=_routed(sandbox_id, **{"X-API-Key": THEIRS}))
        unknown = client.get("/echo", headers=_routed("x" * 20, **{"X-API-Key": THEIRS}))
        assert theirs.status_code == 502, theirs.text
        # Exactly the answer for a sandbox that does not exist.
        assert theirs.json() == {**unknown.json(), "sandboxId": sandbox_id}

        ours = client.get("/echo", headers=_routed(sandbox_id, **{"X-API-Key": OURS}))
        assert ours.status_code == 200, ours.text
        seen = {k.lower() for k, _ in ours.json()["headers"]}
        assert "x-api-key" not in seen  # the guest is never handed a key

        # A value that is no key is the service's own header, passed on; so is no key at all.
        own = client.get("/echo", headers=_routed(sandbox_id, **{"X-API-Key": "svc-token"}))
        assert own.status_code == 200, own.text
        assert ["x-api-key", "svc-token"] in own.json()["headers"]
        assert client.get("/echo", headers=_routed(sandbox_id)).status_code == 200


def test_another_team_s_key_does_not_learn_a_sandbox_is_paused(
    teams_proxy: str, resolver: DictResolver
) -> None:
    resolver.sandboxes["userpaused0000000001"] = FakeSandbox({}, paused=True)
    with httpx.Client(base_url=teams_proxy) as client:
        theirs = client.get(
            "/echo", headers=_routed("userpaused0000000001", **{"X-API-Key": THEIRS})
        )
        ours = client.get("/echo", headers=_routed("userpaused0000000001", **{"X-API-Key": OURS}))
    assert theirs.json()["message"] == "The sandbox was not found"
    assert "paused" in ours.json()["message"]
