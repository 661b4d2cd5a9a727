"""A server stand-in for the stray-VMM test, under a supervisor that is a subreaper (as systemd or
a container's init can be): `python -m tests.runtime.qemu_vm.stray_child supervise ARGS` makes
itself a subreaper and runs `serve ARGS` as its child, which restores a jailed VM from the snapshot
in SNAPSHOT_DIR into WORKDIR (memory in MEMORY_DIR, tap in NETNS), prints `{"server": pid,
"vmm": pid}` as one line on the supervisor's stdout and waits to be killed. Once the server is
killed, its VMM is adopted by the supervisor, not by init; the supervisor reaps what it adopts and
exits when it has no children left."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

from aenv.runtime.driver import NetAttachment, RestoreSpec, Snapshot
from aenv.runtime.qemu import QemuDriver, QemuVM
from tests.runtime.qemu_vm.netns import GUEST_MAC, TAP

PR_SET_CHILD_SUBREAPER = 36


async def serve(snapshot_dir: Path, workdir: Path, memory_dir: Path, netns: str) -> None:
    snapshot = Snapshot.load_manifest(snapshot_dir)
    net = NetAttachment(netns=netns, tap=TAP, mac=GUEST_MAC)
    vm = await QemuDriver().restore(snapshot, RestoreSpec(workdir, net, memory_dir))
    assert isinstance(vm, QemuVM)
    print(json.dumps({"server": os.getpid(), "vmm": vm.proc.pid}), flush=True)
    await asyncio.Event().wait()


def supervise(args: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    subprocess.Popen([sys.executable, "-m", __spec__.name, "serve", *args])
    while True:  # reap whatever is adopted, until killed
        try:
            os.wait()
        except ChildProcessError:
            break


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "supervise":
        supervise(rest)
    else:
        snapshot_dir, workdir, memory_dir, netns = rest
        asyncio.run(serve(Path(snapshot_dir), Path(workdir), Path(memory_dir), netns))
