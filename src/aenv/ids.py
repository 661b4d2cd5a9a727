"""Identifiers and secrets in the shapes E2B clients accept.

Sandbox ids are `[a-z0-9]{20}`: host-based routing splits `{port}-{id}.{domain}` on `-`, so ids
never contain one. API keys are `e2b_` + 40 hex digits: SDKs before 2.6x reject other shapes.
Build ids are UUIDs, as E2B's spec has them (`buildID`, format uuid); those of templates saved
before, 16 hex digits, stay what they are: they name directories.
"""

from __future__ import annotations

import secrets
import string
import uuid

# The default team (`orchestrator.teams`): the first key's, and that of everything a node held
# before teams. Its id is the one team's of those releases, which events, webhooks, secrets
# and gateways recorded: nothing stored needs rewriting.
TEAM_ID = "local"
_ID_ALPHABET = string.ascii_lowercase + string.digits


def new_sandbox_id() -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(20))


def new_api_key() -> str:
    return "e2b_" + secrets.token_hex(20)


def new_build_id() -> str:
    return str(uuid.uuid4())


def new_access_token() -> str:
    return secrets.token_hex(24)
