"""What the sandbox operations raise to their callers (the API maps each to a status)."""

from __future__ import annotations

from aenv.orchestrator.states import SandboxState


class VolumeInUse(RuntimeError):
    """A save that must keep the memory met a volume the guest could not unmount."""


class SandboxNotFound(LookupError):
    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox {sandbox_id} not found")
        self.sandbox_id = sandbox_id


class CreateFailed(RuntimeError):
    """The sandbox could not be started; nothing of it is left."""


class CapacityReached(RuntimeError):
    """The node already holds `max_sandboxes` sandboxes, the request's owner (an API key)
    already runs `key_max_sandboxes`, or the host has not the memory or disk for more."""


class OwnerLimitReached(CapacityReached):
    """The request's team is at one of its own limits: another team's request may still fit."""


class InvalidState(RuntimeError):
    """The operation does not apply in the sandbox's current state (pause of a paused one)."""

    def __init__(
        self, sandbox_id: str, state: SandboxState, operation: str, hint: str = ""
    ) -> None:
        message = f"cannot {operation} sandbox {sandbox_id}: it is {state.value}"
        super().__init__(f"{message} ({hint})" if hint else message)
        self.state = state


class InvalidNetwork(ValueError):
    """Network settings that cannot work, found before anything is made or changed. `field`
    is the E2B name of the setting at fault (`egressProxy`, `dnsServers`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class OperationFailed(RuntimeError):
    """Pause, resume or snapshot failed; the sandbox is left as it was before."""


class GuestUnhealthy(RuntimeError):
    """A pause that asked for a healthy guest found envd not answering; nothing was changed."""
