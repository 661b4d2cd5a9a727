"""The startup sweep kills the VMMs a previous run of the node left (orphaned or still held by
another parent) and removes the cgroups they leave."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from pathlib import Path

import psutil
import pytest

from aenv.runtime.cgroups import CgroupLimits, detect
from aenv.runtime.sweep import our_vmms, reap_strays, reap_unowned, sweep
from tests.support.wait import eventually_sync


def start_qemu(name: str, home: Path, *, orphan: bool, held: bool = False) -> int:
    """A QEMU like ours whose command line names a file under `home`; an `orphan` one's parent
    shell exits at once (as after a server kill -9), the other stays this process's child. A
    `held` orphan keeps a parent that is not this process: a shell, itself orphaned, waiting."""
    argv = ["qemu-system-x86_64", "-M", "microvm", "-S", "-display", "none", "-nodefaults",
            "-name", name, "-qmp", f"unix:{home}/qmp.{name}.sock,server=on,wait=off"]  # fmt: skip
    if not orphan:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid
    if held:
        script = f"sh -c '{' '.join(argv)} >/dev/null 2>&1 & echo $!; exec >&- 2>&-; wait' &"
    else:
        script = " ".join(argv) + " >/dev/null 2>&1 & echo $!"
    return int(subprocess.run(["sh", "-c", script], capture_output=True, text=True).stdout)


def _stop(pids: tuple[int, ...], child: int | None = None) -> None:
    """Kill what a test started: the QEMUs, the shell holding a `held` one, and reap `child`
    (this process's own, if it started one)."""
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            for parent in psutil.Process(pid).parents()[:1]:
                if parent.pid not in (1, os.getpid()):
                    parent.kill()
            psutil.Process(pid).kill()
    if child is not None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, 0)


def _running(pids: set[int], tag: str) -> None:
    """Waits until every pid runs QEMU (not a shell any more)."""
    eventually_sync(lambda: {v.pid for v in our_vmms(tag)} == pids, f"QEMUs {pids} running")


async def test_sweep_reclaims_this_nodes_orphans_only(tmp_path: Path) -> None:
    if not Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory hierarchy on this host")
    # Not `aenv-`: the start-up sweeps of nodes on this machine would remove the group too.
    tag = f"sweepcg-{secrets.token_hex(3)}"
    home, other = tmp_path / "n", tmp_path / "o"  # QMP socket paths stay under 108 bytes
    home.mkdir()
    other.mkdir()
    stale = detect(f"{tag}-old")
    current = detect(f"{tag}-new")
    group = stale.create("qemu-x", CgroupLimits(256 << 20, 32, 1.0))
    pid = start_qemu(f"{tag}-vm", home, orphan=True)
    # Another node's orphan on the same machine: its own start-up sweep's, not ours.
    foreign = start_qemu(f"{tag}-f", other, orphan=True)
    try:
        _running({pid, foreign}, tag)
        group.add(pid)
        # Re-parented when its parent exited, which the run above waited for: no wait here.
        if psutil.Process(pid).ppid() != 1:
            pytest.skip("orphans are re-parented to a subreaper here, not to init")
        report = await sweep(current, prefix=tag, home=home)
        assert report.killed == (pid,)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert [v.pid for v in our_vmms(tag)] == [foreign]
        assert stale.names() == []
        assert any(p.name == "qemu-x" for p in report.cgroups_removed)
    finally:
        _stop((pid, foreign))
        with contextlib.suppress(Exception):
            group.remove()
        stale.remove_parent()
        current.remove_parent()


def test_strays_of_this_node_are_killed_and_nothing_else(tmp_path: Path) -> None:
    # Not `aenv-`: other nodes' start-up sweeps on this machine would kill our orphans too.
    tag = f"straytest-{secrets.token_hex(3)}"
    home, other = tmp_path / "node", tmp_path / "other-node"
    home.mkdir()
    other.mkdir()
    stray = start_qemu(f"{tag}-stray", home, orphan=True)
    child = start_qemu(f"{tag}-child", home, orphan=False)
    foreign = start_qemu(f"{tag}-foreign", other, orphan=True)
    try:
        _running({stray, child, foreign}, tag)
        killed = reap_strays(home, prefix=tag)
        assert [v.pid for v in killed] == [stray]
        assert not psutil.pid_exists(stray) or psutil.Process(stray).status() == "zombie"
        assert {v.pid for v in our_vmms(tag)} == {child, foreign}
        assert reap_strays(home, prefix=tag) == []
    finally:
        _stop((stray, child, foreign), child)


async def test_the_startup_sweep_kills_this_nodes_vmms_whose_parent_lives_on(
    tmp_path: Path,
) -> None:
    # Not `aenv-`: other nodes' start-up sweeps on this machine would kill these too.
    tag = f"sweeptest-{secrets.token_hex(3)}"
    home, other = tmp_path / "node", tmp_path / "other-node"
    home.mkdir()
    other.mkdir()
    # A previous server's VMM still held by a live parent that is not this process (a helper
    # of a server being torn down, a subreaper), and one of this process.
    kept = start_qemu(f"{tag}-held", home, orphan=True, held=True)
    child = start_qemu(f"{tag}-child", home, orphan=False)
    foreign = start_qemu(f"{tag}-foreign", other, orphan=True, held=True)
    try:
        _running({kept, child, foreign}, tag)
        assert psutil.Process(kept).ppid() not in (1, os.getpid())
        report = await sweep(None, prefix=tag, home=home)
        assert report.killed == (kept,)
        assert {v.pid for v in our_vmms(tag)} == {child, foreign}
    finally:
        _stop((kept, child, foreign), child)


def test_the_reaper_keeps_the_group_of_a_vmm_launched_while_it_runs() -> None:
    """`reap_unowned` runs in a thread while the node launches VMMs: a launch that begins after
    the reaper first asked what is owned has a group, still empty, by the time the reaper lists
    them. It must stay (it was removed under the launch: "cannot write <pid> to cgroup.procs")."""
    manager = detect(f"aenv-test-{secrets.token_hex(3)}-{os.getpid()}")
    stale = manager.create("qemu-stale", CgroupLimits(None, None, None))
    owned: list[str] = []
    launched: list[object] = []

    def owned_now() -> list[str]:
        if not launched:  # the launch begins right after the reaper's first question
            launched.append(manager.create("qemu-launching", CgroupLimits(None, None, None)))
            answer = list(owned)
            owned.append("aenv-launching")
            return answer
        return list(owned)

    try:
        reap_unowned(owned_now, manager, lambda name: f"qemu-{name.removeprefix('aenv-')}")
        assert manager.names() == ["qemu-launching"]
    finally:
        for group in (stale, *launched):
            group.remove()  # type: ignore[attr-defined]
        manager.remove_parent()
