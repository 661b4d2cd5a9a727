"""Sandbox lifecycle states and the one table of moves between them.

The catalog refuses any move the table lacks (`Catalog.transition` raises `IllegalTransition`),
so a new operation cannot invent a path through the lifecycle by accident:

```
CREATING ------> RUNNING <------> SNAPSHOTTING
                 |     ^
                 v     | (the pause failed)
                 PAUSING ------> PAUSED <------> RESUMING ------> RUNNING
                    |       (failed)  ^
                    v                 |  (a pause, or its timeout with autoPause)
                 HIBERNATED ----------+
                    ^    |
          (failed)  |    v
                    WAKING ------> RUNNING
any state but KILLING ------> KILLING (then the row is deleted)
```

A pause or resume that fails goes back where it started. HIBERNATED is a pause the node took
on its own (idle hibernation, see hibernation.py): the VM is stopped and its checkpoint saved,
but for the API the sandbox runs, and its next request wakes it (WAKING). A restart takes a
sandbox caught mid-pause, mid-resume, hibernated or waking to PAUSED.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class SandboxState(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    SNAPSHOTTING = "snapshotting"
    HIBERNATED = "hibernated"
    WAKING = "waking"
    KILLING = "killing"

    @property
    def public(self) -> str | None:
        """The E2B API's view: only `running` and `paused` exist there."""
        if self in _PUBLIC_RUNNING:
            return "running"
        if self in _PUBLIC_PAUSED:
            return "paused"
        return None


class IllegalTransition(ValueError):
    """A move the transition table does not allow: a bug in the caller, not a race."""


_S = SandboxState
# Where each state may go; staying in a state (a change of other fields) is always allowed.
TRANSITIONS: Mapping[SandboxState, frozenset[SandboxState]] = {
    _S.CREATING: frozenset({_S.RUNNING, _S.KILLING}),
    _S.RUNNING: frozenset({_S.PAUSING, _S.SNAPSHOTTING, _S.KILLING}),
    _S.SNAPSHOTTING: frozenset({_S.RUNNING, _S.KILLING}),
    _S.PAUSING: frozenset({_S.PAUSED, _S.HIBERNATED, _S.RUNNING, _S.KILLING}),
    _S.HIBERNATED: frozenset({_S.WAKING, _S.PAUSED, _S.KILLING}),
    _S.WAKING: frozenset({_S.RUNNING, _S.HIBERNATED, _S.KILLING}),
    _S.PAUSED: frozenset({_S.RESUMING, _S.KILLING}),
    _S.RESUMING: frozenset({_S.RUNNING, _S.PAUSED, _S.KILLING}),
    _S.KILLING: frozenset(),
}


def check_transition(allowed_from: frozenset[SandboxState], to: SandboxState) -> None:
    """Raise `IllegalTransition` unless every state in `allowed_from` may move to `to`."""
    illegal = sorted(s.value for s in allowed_from if s is not to and to not in TRANSITIONS[s])
    if illegal:
        raise IllegalTransition(f"no move from {', '.join(illegal)} to {to.value}")


_PUBLIC_RUNNING = frozenset({_S.RUNNING, _S.SNAPSHOTTING, _S.PAUSING, _S.HIBERNATED, _S.WAKING})
_PUBLIC_PAUSED = frozenset({_S.PAUSED, _S.RESUMING})


def with_public(public: str) -> frozenset[SandboxState]:
    """The states the E2B API shows as `public` ("running" or "paused")."""
    return frozenset(s for s in SandboxState if s.public == public)


# States a kill may start from: anything alive. A sandbox still being created is killed by its
# creator once the VM exists, so CREATING is included and the creator checks before reporting.
KILLABLE = frozenset(s for s in SandboxState if _S.KILLING in TRANSITIONS[s])
# States in which the sandbox's VM runs.
# What the E2B API shows running: an execution of the sandbox is under way.
RUNS = _PUBLIC_RUNNING
LIVE = frozenset({_S.RUNNING, _S.SNAPSHOTTING, _S.PAUSING})
# States a restart finds a saved checkpoint in (it takes them to PAUSED).
SAVED = frozenset({_S.PAUSED, _S.PAUSING, _S.RESUMING, _S.HIBERNATED, _S.WAKING})
# States of a sandbox the node hibernated (it runs for the API; its next request wakes it).
ASLEEP = frozenset({_S.HIBERNATED, _S.WAKING})
