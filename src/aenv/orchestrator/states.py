"""Sandbox lifecycle states and which transitions each operation may start from."""

from __future__ import annotations

import enum


class SandboxState(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    SNAPSHOTTING = "snapshotting"
    KILLING = "killing"
    DEAD = "dead"

    @property
    def public(self) -> str | None:
        """The E2B API's view: only `running` and `paused` exist there."""
        if self in _PUBLIC_RUNNING:
            return "running"
        if self in _PUBLIC_PAUSED:
            return "paused"
        return None


_PUBLIC_RUNNING = frozenset({SandboxState.RUNNING, SandboxState.SNAPSHOTTING, SandboxState.PAUSING})
_PUBLIC_PAUSED = frozenset({SandboxState.PAUSED, SandboxState.RESUMING})


def with_public(public: str) -> frozenset[SandboxState]:
    """The states the E2B API shows as `public` ("running" or "paused")."""
    return frozenset(s for s in SandboxState if s.public == public)


# States a kill may start from: anything alive. A sandbox still being created is killed by its
# creator once the VM exists, so CREATING is included and the creator checks before reporting.
KILLABLE = frozenset(SandboxState) - {SandboxState.KILLING, SandboxState.DEAD}
LIVE = frozenset({SandboxState.RUNNING, SandboxState.SNAPSHOTTING, SandboxState.PAUSING})
