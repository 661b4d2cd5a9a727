"""The jail's parts that need no VM: uids handed out, file access granted, configuration (the
jail on by default, Firecracker through its jailer), and a jailed process found by the sweep."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from aenv.claims import derive
from aenv.config import ConfigError, load
from aenv.runtime.cgroups import CgroupLimits, CgroupV1, CgroupV2, detect
from aenv.runtime.jail import (
    Access,
    Jail,
    JailConfig,
    JailError,
    JailFile,
    UidPool,
    grant,
    host_binary,
)
from aenv.runtime.sweep import sweep
from aenv.server import firecracker_config, jail_config
from tests.support.jail import jail_problems

CHILD = Path(__file__).with_name("jail_child.py")


def test_uids_are_distinct_and_come_back() -> None:
    pool = UidPool(JailConfig(uid_base=5000, uid_count=3))
    uids = {pool.acquire() for _ in range(3)}
    assert uids == {5001, 5002, 5003}  # the base itself is the group
    with pytest.raises(JailError):
        pool.acquire()
    pool.release(5002)
    assert pool.acquire() == 5002


def test_grant_gives_each_file_its_access(tmp_path: Path) -> None:
    own, shared, mapped = (tmp_path / n for n in ("own", "shared", "mapped"))
    for path in (own, shared, mapped):
        path.write_bytes(b"x")
        path.chmod(0o600)
        os.chown(path, 4321, 4321)  # e.g. left by an earlier VMM
    volume = tmp_path / "volume"
    volume.mkdir(mode=0o700)
    grant(
        [
            JailFile(own, Access.OWN),
            JailFile(shared, Access.READ),
            JailFile(mapped, Access.SHARED_WRITE),
            JailFile(volume, Access.SHARED_DIR),
        ],
        uid=5001,
        gid=5000,
    )

    def who(path: Path) -> tuple[int, int, int]:
        st = path.stat()
        return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)

    assert who(own) == (5001, 5000, 0o600)
    assert who(shared) == (0, 5000, 0o640)
    assert who(mapped) == (0, 5000, 0o660)
    assert who(volume) == (0, 5000, 0o777)  # every VMM and guest user writes in a volume
    with pytest.raises(JailError):
        grant([JailFile(tmp_path / "missing", Access.READ)], uid=5001, gid=5000)


def test_only_programs_under_usr_run_jailed(tmp_path: Path) -> None:
    assert host_binary("setpriv").is_relative_to("/usr")
    elsewhere = tmp_path / "qemu-system-x86_64"
    elsewhere.write_text("#!/bin/sh\n")
    elsewhere.chmod(0o755)
    with pytest.raises(JailError, match="cannot run jailed"):
        host_binary(str(elsewhere))


async def test_a_jail_that_cannot_be_built_fails_cleanly(tmp_path: Path) -> None:
    inner = tmp_path / "d" / "f"
    inner.parent.mkdir()
    inner.write_bytes(b"x")
    # The directory is bound read-only first, so the file's mount point cannot be made in it.
    files = [JailFile(inner.parent, Access.READ), JailFile(inner, Access.READ)]
    with pytest.raises(JailError, match="cannot build the jail"):
        async with Jail(uid=2_065_535, gid=2_000_000).assemble(files):
            pytest.fail("a jail without its files was built")
    assert not [t for t in threading.enumerate() if t.name.startswith("jail:")]


def test_the_jail_is_on_unless_configured_off(tmp_path: Path) -> None:
    env = {"AENV_HOME": str(tmp_path)}
    config = load(env={**env, "AENV_JAIL_UID_BASE": "5000"})
    jail = jail_config(derive(config, [], "net"))
    assert jail == JailConfig(uid_base=5000)
    fc = firecracker_config(config, CgroupV2("aenv-x", root=tmp_path, proc_cgroup="0::/"), jail)
    assert fc.jailer is not None and fc.jail_uids == jail  # a uid per VM from the range
    assert fc.jailer.uid == fc.jailer.gid == 5000
    assert fc.jailer.chroot_base_dir == tmp_path / "jailer" and fc.jailer.cgroup_version == 2
    v1 = CgroupV1("aenv-x", root=tmp_path, proc_cgroup="")
    assert (j := firecracker_config(config, v1, jail).jailer) is not None and j.cgroup_version == 1
    off = load(env={**env, "AENV_JAIL": "false"})
    assert jail_config(derive(off, [], "net")) is None
    assert firecracker_config(off, v1, None).jailer is None
    with pytest.raises(ConfigError):
        load(env={**env, "AENV_JAIL": "maybe"})


async def test_the_sweep_finds_and_kills_a_jailed_orphan(tmp_path: Path) -> None:
    if not Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory hierarchy on this host")
    tag = f"aenv-jailtest{os.getpid()}-"
    stale, current = detect(f"{tag}old"), detect(f"{tag}new")
    group = stale.create("qemu-x", CgroupLimits(256 << 20, 32, 1.0))
    # The child starts a jailed QEMU and exits: the QEMU is re-parented, as after a crash.
    out = subprocess.run(
        [sys.executable, str(CHILD), f"{tag}vm", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(out.stdout)
    try:
        group.add(pid)
        # Re-parented when its parent exited, which the run above waited for: no wait here.
        if psutil.Process(pid).ppid() != 1:
            pytest.skip("orphans are re-parented to a subreaper here, not to init")
        assert jail_problems(pid, []) == []
        report = await sweep(current, prefix=tag, home=tmp_path)
        assert report.killed == (pid,)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert stale.names() == []
    finally:
        if psutil.pid_exists(pid):
            psutil.Process(pid).kill()
        with contextlib.suppress(Exception):
            group.remove()
        stale.remove_parent()
        current.remove_parent()
