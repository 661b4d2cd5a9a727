"""The registry of processes envd started, with retention of finished ones.

A finished process stays connectable for `retention` seconds so a client that reattaches late
still receives its `start` and `end` events.
"""

from __future__ import annotations

import asyncio
import signal

from aenv.envd.process.handle import ProcessHandle


class ProcessTable:
    def __init__(self, retention: float) -> None:
        self._retention = retention
        self._by_pid: dict[int, ProcessHandle] = {}
        self._expiries: set[asyncio.Task[None]] = set()

    def add(self, handle: ProcessHandle) -> None:
        self._by_pid[handle.pid] = handle
        task = asyncio.get_running_loop().create_task(self._expire_after_exit(handle))
        self._expiries.add(task)
        task.add_done_callback(self._expiries.discard)

    async def _expire_after_exit(self, handle: ProcessHandle) -> None:
        await handle.done.wait()
        await asyncio.sleep(self._retention)
        # A recycled pid may belong to a newer process by now; drop only this one.
        if self._by_pid.get(handle.pid) is handle:
            del self._by_pid[handle.pid]

    def by_pid(self, pid: int) -> ProcessHandle | None:
        return self._by_pid.get(pid)

    def by_tag(self, tag: str) -> ProcessHandle | None:
        matches = [h for h in self._by_pid.values() if h.spec.tag == tag]
        running = [h for h in matches if h.exit is None]
        candidates = running or matches
        return candidates[-1] if candidates else None

    def running(self) -> list[ProcessHandle]:
        return [h for h in self._by_pid.values() if h.exit is None]

    def kill_all(self) -> None:
        for handle in self.running():
            handle.signal(signal.SIGKILL)
