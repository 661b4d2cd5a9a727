"""A webhook registration the team tests make on a node and through a cluster's gateways: one
that never delivers (disabled, to a name outside the machine), so nothing leaves the host."""

from __future__ import annotations

from typing import Any

QUIET_WEBHOOK: dict[str, Any] = {
    "name": "h",
    "url": "https://hooks.example.com/e2b",
    "enabled": False,  # never delivers: nothing leaves the machine
    "events": ["sandbox.lifecycle.created"],
    "signatureSecret": "s" * 32,
}
