"""Helper programs die with the process that started them: a kill -9 of a server leaves no
`qemu-img` or `cp` writing into files the next start reclaims."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest

from aenv.guest.proc import BuildError
from aenv.guest.proc import run as build_step
from aenv.storage.layers import LayerError, run_tool
from tests.support.wait import SAFETY_S, eventually_sync

# A server stand-in: starts `sleep` through one of the runners and waits on it.
STARTERS = {
    "disk tool": "from aenv.storage.layers import run_tool as start",
    "build step": "from aenv.guest.proc import run as start",
}


def _child(pid: int) -> psutil.Process:
    def started() -> psutil.Process | None:
        return next((c for c in psutil.Process(pid).children() if c.name() == "sleep"), None)

    return eventually_sync(started, "the helper program started")


@pytest.mark.parametrize("starter", sorted(STARTERS))
def test_a_helper_program_dies_with_its_killed_starter(starter: str) -> None:
    code = f"import asyncio\n{STARTERS[starter]}\nasyncio.run(start('sleep', '600'))"
    server = subprocess.Popen([sys.executable, "-c", code])
    tool: psutil.Process | None = None
    try:
        tool = _child(server.pid)
        server.send_signal(signal.SIGKILL)
        server.wait()
        _gone, alive = psutil.wait_procs([tool], timeout=SAFETY_S)
        assert not alive, "the helper outlived the process that started it"
    finally:
        server.kill()
        server.wait()
        if tool is not None and tool.is_running():
            tool.kill()


async def test_a_missing_program_is_an_error_that_names_it() -> None:
    with pytest.raises(LayerError, match="no-such-tool"):
        await run_tool("no-such-tool", "x")
    with pytest.raises(BuildError, match="no-such-tool"):
        await build_step("no-such-tool")
