"""Idle hibernation (config `hibernate_after`, off at 0): which running sandboxes have been
idle long enough to be paused behind their users' backs, and whether their guest still runs
a command.

A sandbox is idle when no data-plane exchange with it is open and none has started or ended for
`after` seconds since it last started running (create, resume or wake). The proxy knows the
exchanges (`TrafficView`); this module keeps when each sandbox last started running and asks
the guest's envd, once a sandbox is idle, whether a command or PTY still runs there (a
template's start command counts: it is a process envd started). The orchestrator pauses the
sandboxes found idle into state HIBERNATED and wakes them on their next request.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import pyqwest
from connectrpc.errors import ConnectError

from aenv.envd.proto.process import process_pb as pb
from aenv.envd.proto.process.process_connect import ProcessClient
from aenv.orchestrator.envd_client import EnvdClient, EnvdUnavailable, rpc_transport

# How long the question to envd may take: an idle guest answers in milliseconds, a busy host
# may delay it; no answer keeps the sandbox awake.
_LIST_TIMEOUT_MS = 10_000


class TrafficView(Protocol):
    """The data plane's view of a sandbox's traffic (the proxy implements it)."""

    def quiet_since(self, sandbox_id: str) -> float | None:
        """None while an exchange with the sandbox is open; else the `time.monotonic()` when
        the latest one started or ended (0.0 when there was none)."""
        ...


@dataclass
class Hibernation:
    """The idle clocks of the running sandboxes; `after` 0 turns hibernation off."""

    after: float
    traffic: TrafficView | None = None
    _since: dict[str, float] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.after > 0

    @property
    def interval(self) -> float:
        """Seconds between two looks for idle sandboxes: a fraction of `after`, so a sandbox
        hibernates at most a quarter later than due, and never more often than twice a second."""
        return max(0.5, min(self.after / 4, 15.0))

    def awake(self, sandbox_id: str) -> None:
        """The sandbox started running (or was found busy): its idle clock starts again.
        Nothing is kept while hibernation is off (no look would ever drop it)."""
        if self.enabled:
            self._since[sandbox_id] = time.monotonic()

    def keep_only(self, sandbox_ids: Iterable[str]) -> None:
        keep = set(sandbox_ids)
        for gone in self._since.keys() - keep:
            del self._since[gone]

    def due(self, sandbox_ids: Iterable[str]) -> list[str]:
        """Those of `sandbox_ids` idle for `after` seconds or more."""
        now = time.monotonic()
        found = []
        for sandbox_id in sandbox_ids:
            since = self._since.setdefault(sandbox_id, now)
            if self.traffic is not None:
                quiet = self.traffic.quiet_since(sandbox_id)
                if quiet is None:
                    continue
                since = max(since, quiet)
            if now - since >= self.after:
                found.append(sandbox_id)
        return found


async def guest_runs_commands(envd: EnvdClient) -> bool:
    """Whether envd in the guest runs any process it started (a command, a PTY). Raises
    `EnvdUnavailable` when it does not answer."""
    # A pool of its own, closed after: the node's would keep a connection to this address,
    # which the sandbox gives up when it hibernates.
    transport = rpc_transport()
    rpc = ProcessClient(envd.url, http_client=pyqwest.Client(transport))
    try:
        listed = await rpc.list(
            pb.ListRequest(), headers=envd.headers(), timeout_ms=_LIST_TIMEOUT_MS
        )
    except ConnectError as e:
        raise EnvdUnavailable(f"envd process list at {envd.url}: {e}") from e
    finally:
        await rpc.close()
        await transport.aclose()
    return len(listed.processes) > 0
