"""The startup sweep kills orphaned VMMs and removes the cgroups they leave."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from aenv.runtime.cgroups import CgroupLimits, detect
from aenv.runtime.sweep import sweep


def start_orphan(name: str) -> int:
    """A QEMU whose parent shell exits at once, so it is re-parented like after a server crash."""
    out = subprocess.run(
        ["sh", "-c", f"qemu-system-x86_64 -M microvm -S -display none -nodefaults "
                     f"-name {name} >/dev/null 2>&1 & echo $!"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return int(out)


async def test_sweep_reclaims_orphans() -> None:
    if not Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory hierarchy on this host")
    tag = f"aenv-sweeptest-{secrets.token_hex(3)}"
    stale = detect(f"{tag}-old")
    current = detect(f"{tag}-new")
    group = stale.create("qemu-x", CgroupLimits(256 << 20, 32, 1.0))
    pid = start_orphan(f"{tag}-vm")
    try:
        group.add(pid)
        deadline = time.monotonic() + 5
        while psutil.Process(pid).ppid() != 1:
            if time.monotonic() > deadline:
                pytest.skip("orphans are re-parented to a subreaper here, not to init")
            time.sleep(0.05)
        report = await sweep(current, prefix=tag)
        assert report.killed == (pid,)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert stale.names() == []
        assert any(p.name == "qemu-x" for p in report.cgroups_removed)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()
        with contextlib.suppress(Exception):
            group.remove()
        stale.remove_parent()
        current.remove_parent()
