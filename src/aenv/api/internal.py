"""What the control plane knows of calls a cluster gateway makes on a user's behalf.

`aenv.cluster.internal.InternalGate` authenticates them with the cluster secret and records here,
in the request's ASGI state, the caller the gateway checked: its API key id and that key's team
(`caller_of`: "<key id> <team id>", sent as two headers; a gateway from before teams sends the
key id alone, whose team is the default one). The control plane then acts for that key and team
(the key records what it creates, the team owns it) without a key of its own, and adds what only
a gateway needs (the list's per-item cursors, so it can merge the lists of several nodes). A
refused request records its `Refusal` in the same state, for the internal API's answer
(`api.internal_v1`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from starlette.requests import Request

from aenv.api.errors import APIError
from aenv.api.internal_models import Refusal
from aenv.api.keys import ApiKey
from aenv.api.requests import check_query
from aenv.ids import TEAM_ID

# The ASGI state entry holding the caller a gateway acts for (`caller_of`).
CALLER_STATE = "cluster_caller"
# The caller of a call made with the cluster token but for no user: a gateway's own, or its
# operator's (`aenv.cluster.internal`).
OPERATOR_CALLER = "cluster"
# The ASGI state entry holding the `Refusal` of a request the control plane refused.
REFUSAL_STATE = "cluster_refusal"
# The header of `GET /v2/sandboxes` that gives a gateway each listed sandbox's cursor.
CURSORS_HEADER = "X-Aenv-Cursors"


def caller(state: Mapping[str, Any]) -> str | None:
    """The caller a gateway acts for, or None for a request that did not come through one."""
    value = state.get(CALLER_STATE)
    return value if isinstance(value, str) else None


def by_operator(state: Mapping[str, Any]) -> bool:
    """Whether the request is a gateway's call for no user: the cluster's operator's."""
    return caller(state) == OPERATOR_CALLER


def gateway_only(request: Request) -> None:
    """Refuses a request that did not come through the cluster's internal API as a 404: the
    route does not exist for a user's key. No query string is taken."""
    check_query(request)
    if caller(request.scope.get("state", {})) is None:
        raise APIError(404, f"{request.url.path} not found")


def caller_of(key: ApiKey) -> str:
    """How a gateway names the key it checked to a node."""
    return f"{key.id} {key.team_id}"


def caller_key(named: str) -> ApiKey:
    """The key record a gateway's call acts as: the gateway holds the key itself, so only its
    id (recorded with what the call creates) and team are known here."""
    key_id, _, team_id = named.partition(" ")
    return ApiKey(
        id=key_id,
        team_id=team_id or TEAM_ID,
        name="gateway",
        digest="",
        value_length=0,
        masked_prefix="",
        masked_suffix="",
        created_at=0.0,
    )


def record_refusal(scope: MutableMapping[str, Any], refusal: Refusal) -> None:
    """Notes in the request's state why the control plane refused it."""
    scope.setdefault("state", {})[REFUSAL_STATE] = refusal
