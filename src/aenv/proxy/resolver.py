"""The proxy's one question to the orchestrator: where does traffic for (sandbox, port) go?

The orchestrator implements `Resolver`; the proxy never reads the catalog or the network slots
itself. A resolver may do work before answering (resume a paused sandbox on traffic, wait for a
transition): the proxy awaits `resolve` per request and needs no change when that arrives. It
raises `SandboxNotFound`, `SandboxPaused` or `SandboxUnavailable` instead of returning; a port
with nothing listening is not its concern, the proxy finds out when it connects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Upstream:
    """Where to connect: the sandbox's host-side network-slot address (`host`) and the guest
    port (`port`). `traffic_access_token`, when set, is required from clients on every port but
    envd's (which checks its own access token), in the `e2b-traffic-access-token` header.

    `incarnation` names this run of the sandbox's VM (it must change when the VM is restored or
    resumed): the proxy reuses kept-alive connections only within one sandbox id and
    incarnation, so a connection opened before a pause, whose guest side may be gone, is
    never sent a request after the resume.

    `mask_request_host`, when set, replaces the `Host` clients sent on every port but envd's,
    with `${PORT}` in it standing for the port (E2B's `maskRequestHost`).

    `tls`: the service on the port speaks HTTPS itself (E2B's `httpsPorts`); the proxy still
    ends the client's TLS, and reaches the port over TLS of its own without verifying the
    sandbox's certificate (self-signed ones work, as in E2B)."""

    host: str
    port: int
    traffic_access_token: str | None = None
    incarnation: str = ""
    mask_request_host: str | None = None
    tls: bool = False


class ResolveError(Exception):
    """The sandbox cannot take traffic; subclasses say why."""

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(sandbox_id)
        self.sandbox_id = sandbox_id


class SandboxNotFound(ResolveError):
    """No such sandbox, or it is gone (killed, timed out)."""


class SandboxPaused(ResolveError):
    """The sandbox exists but is paused and the resolver did not resume it."""


class SandboxUnavailable(ResolveError):
    """The sandbox exists but could not be made to take traffic now (a resume or a wake from
    hibernation failed); `reason` says why. It is left as it was: a later request tries again."""

    def __init__(self, sandbox_id: str, reason: str) -> None:
        super().__init__(sandbox_id)
        self.reason = reason


class Resolver(Protocol):
    async def resolve(self, sandbox_id: str, port: int) -> Upstream:
        """The upstream for `port` of `sandbox_id`; raises `SandboxNotFound`,
        `SandboxPaused` or `SandboxUnavailable`.
        Called once per HTTP request and per WebSocket, so it should answer from memory when the
        sandbox is running."""
        ...
