"""The jailer option: command line, chroot layout, hard links, cgroup bookkeeping, and the driver's
whole lifecycle through `fake_jailer.py` (which lays out and enters the jail the way the jailer
does, without chroot) in front of the `fc_peer.py` Firecracker stand-in."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from aenv.mounts import is_shared, mounts_under
from aenv.runtime import driver as d
from aenv.runtime.firecracker import FirecrackerDriver
from aenv.runtime.firecracker.jailer import Jail, JailerConfig, JailError, cgroup_settings
from aenv.runtime.firecracker.vm import UFFD_SOCKET, FirecrackerVM
from aenv.runtime.jail import JailConfig
from tests.runtime.firecracker import shared_output_child
from tests.runtime.firecracker.conftest import REPO
from tests.runtime.firecracker.fc_peer import PAGE
from tests.runtime.firecracker.fc_support import (
    memory_elsewhere,
    page,
    restore_target,
    snapshot_target,
    touched,
)

HERE = Path(__file__).resolve().parent
UID, GID = 12345, 23456


def config(tmp_path: Path, **kw: object) -> JailerConfig:
    return JailerConfig(
        binary=Path("/usr/bin/jailer"),
        uid=UID,
        gid=GID,
        chroot_base_dir=tmp_path / "jails",
        **kw,  # type: ignore[arg-type]
    )


def test_argv_carries_identity_cgroups_limits_netns_and_firecracker_args(tmp_path: Path) -> None:
    jail = Jail(
        config(tmp_path, cgroup_version=1, parent_cgroup="aenv", resource_limits={"no-file": 4096}),
        "fc-0123",
        Path("/opt/fc/firecracker"),
    )
    limits = cgroup_settings(1, memory_bytes=320 << 20, pids=18, cpu_cores=1.5)
    argv = jail.argv(netns="sbx1", cgroups=limits, firecracker_args=["--level", "Warning"])
    assert argv == [
        "/usr/bin/jailer",
        "--id", "fc-0123",
        "--exec-file", "/opt/fc/firecracker",
        "--uid", str(UID),
        "--gid", str(GID),
        "--chroot-base-dir", str(tmp_path / "jails"),
        "--cgroup-version", "1",
        "--parent-cgroup", "aenv",
        "--cgroup", f"memory.limit_in_bytes={320 << 20}",
        "--cgroup", "pids.max=18",
        "--cgroup", "cpu.cfs_period_us=100000",
        "--cgroup", "cpu.cfs_quota_us=150000",
        "--resource-limit", "no-file=4096",
        "--netns", "/run/netns/sbx1",
        "--", "--api-sock", "/api.sock", "--level", "Warning",
    ]  # fmt: skip
    assert jail.root == tmp_path / "jails" / "firecracker" / "fc-0123" / "root"
    assert jail.socket_path == jail.root / "api.sock"


def test_cgroup_settings_per_hierarchy_version() -> None:
    assert cgroup_settings(2, memory_bytes=1 << 30, pids=20, cpu_cores=2) == {
        "memory.max": str(1 << 30),
        "pids.max": "20",
        "cpu.max": "200000 100000",
    }
    assert cgroup_settings(1, memory_bytes=None, pids=None, cpu_cores=None) == {}


def test_jail_ids_follow_the_jailers_rule(tmp_path: Path) -> None:
    for bad in ("", "a" * 65, "fc_1", "../x", "fc 1"):
        with pytest.raises(JailError):
            Jail(config(tmp_path), bad, Path("/x/firecracker"))


def test_link_in_hard_links_and_hands_files_to_the_jail_user(tmp_path: Path) -> None:
    jail = Jail(config(tmp_path), "fc-1", Path("/x/firecracker"))
    jail.create()
    with pytest.raises(JailError, match="already exists"):
        jail.create()
    disk = tmp_path / "upper.img"
    disk.write_bytes(b"layer")
    assert jail.link_in(disk, "drives/upper", writable=True) == "drives/upper"
    inside = jail.root / "drives" / "upper"
    assert inside.stat().st_ino == disk.stat().st_ino  # same file: guest writes land in the layer
    assert (inside.stat().st_uid, inside.stat().st_gid) == (UID, GID)


def test_read_only_files_are_made_readable_by_the_jails_group_only(tmp_path: Path) -> None:
    jail = Jail(config(tmp_path), "fc-4", Path("/x/firecracker"))
    jail.create()
    readable, private = tmp_path / "base.ext4", tmp_path / "state"
    for path, mode in ((readable, 0o644), (private, 0o600)):
        path.write_bytes(b"x")
        path.chmod(mode)
    jail.link_in(readable, "drives/base")
    st = readable.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (os.getuid(), os.getgid(), 0o644)
    jail.link_in(private, "restore/state")  # a node file: 0600 root
    st = private.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, GID, 0o640)


def test_files_from_another_filesystem_are_bind_mounted_and_unmounted(
    tmp_path: Path, shm_dir: Path
) -> None:
    if os.stat(shm_dir).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the temp dir")
    jail = Jail(config(tmp_path), "fc-2", Path("/x/firecracker"))
    jail.create()
    memory = shm_dir / "memory.bin"
    memory.write_bytes(b"saved memory")
    memory.chmod(0o644)
    layer = shm_dir / "upper.img"
    layer.write_bytes(b"layer")
    assert jail.link_in(memory, "restore/memory.bin") == "restore/memory.bin"
    assert jail.link_in(layer, "drives/upper", writable=True) == "drives/upper"
    inside = jail.root / "restore" / "memory.bin"
    assert mounts_under(jail.root.resolve()) == [
        (jail.root / "drives" / "upper").resolve(),
        inside.resolve(),
    ]
    assert inside.read_bytes() == b"saved memory"
    with pytest.raises(OSError, match="Read-only file system"):
        inside.write_bytes(b"changed")
    (jail.root / "drives" / "upper").write_bytes(b"guest wrote")
    assert layer.read_bytes() == b"guest wrote"  # the same file: writes land in the layer
    assert (layer.stat().st_uid, layer.stat().st_gid) == (UID, GID)
    assert memory.stat().st_uid == os.getuid()  # a shared file keeps its owner

    jail.remove({})
    assert mounts_under(tmp_path.resolve()) == [] and not jail.instance_dir.exists()
    assert memory.read_bytes() == b"saved memory" and layer.read_bytes() == b"guest wrote"


def test_outputs_on_another_filesystem_are_written_in_the_jail_and_moved_out(
    tmp_path: Path, shm_dir: Path
) -> None:
    """This host's mounts are private: a bind made while the jail runs would not reach it."""
    if os.stat(shm_dir).st_dev == os.stat(tmp_path).st_dev or is_shared(tmp_path):
        pytest.skip("needs /dev/shm on another filesystem and a private temp dir mount")
    jail = Jail(config(tmp_path), "fc-5", Path("/x/firecracker"))
    jail.create()
    destination = shm_dir / "memory.bin"
    assert jail.output("out/memory.bin", destination) == "out/memory.bin"
    assert not destination.exists() and mounts_under(tmp_path.resolve()) == []
    jail.host_path("out/memory.bin").write_bytes(b"memory")
    assert jail.take_out("out/memory.bin", destination).read_bytes() == b"memory"
    assert not jail.host_path("out/memory.bin").exists()


def test_outputs_reach_a_running_jail_on_a_shared_mount(tmp_path: Path) -> None:
    """Where the chroot's mount propagates, an output is bound in after the jailer started and
    Firecracker writes straight into the destination on another filesystem (no copy)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and util-linux unshare")
    result = subprocess.run(
        [
            *("unshare", "--mount", "--propagation", "private"),
            *(sys.executable, "-m", shared_output_child.__name__, str(tmp_path)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "destination": shared_output_child.WRITTEN,
        "bound": True,
    }


def test_outputs_on_the_jails_filesystem_are_written_in_place(tmp_path: Path) -> None:
    jail = Jail(config(tmp_path), "fc-6", Path("/x/firecracker"))
    jail.create()
    destination = tmp_path / "state"
    assert jail.output("out/state", destination) == "out/state"
    jail.host_path("out/state").write_bytes(b"state")
    assert destination.read_bytes() == b"state"  # no copy: the same file
    assert (destination.stat().st_uid, destination.stat().st_gid) == (UID, GID)
    assert jail.take_out("out/state", destination).read_bytes() == b"state"
    assert not jail.host_path("out/state").exists()


MOUNTS = """\
sysfs /sys sysfs rw 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""


def test_cgroup_dirs_are_found_like_the_jailer_finds_them(tmp_path: Path) -> None:
    v1 = Jail(config(tmp_path, cgroup_version=1), "fc-3", Path("/x/firecracker"))
    settings = cgroup_settings(1, memory_bytes=1, pids=1, cpu_cores=1)
    assert v1.cgroup_dirs(settings, MOUNTS) == [
        Path("/sys/fs/cgroup/cpu/firecracker/fc-3"),
        Path("/sys/fs/cgroup/memory/firecracker/fc-3"),
        Path("/sys/fs/cgroup/pids/firecracker/fc-3"),
    ]
    v2 = Jail(config(tmp_path, parent_cgroup="aenv"), "fc-3", Path("/x/firecracker"))
    assert v2.cgroup_dirs({"memory.max": "1"}, MOUNTS) == [Path("/sys/fs/cgroup/unified/aenv/fc-3")]
    assert v2.cgroup_dirs({}, MOUNTS) == []  # v2 without --cgroup: the jailer makes no group


@pytest.fixture
def jailed_driver(
    driver: FirecrackerDriver, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> FirecrackerDriver:
    jailer = tmp_path_factory.mktemp("jailer-bin") / "jailer"
    jailer.write_text(f'#!/bin/sh\nexec {sys.executable} {HERE / "fake_jailer.py"} "$@"\n')
    jailer.chmod(0o755)
    jail_config = JailerConfig(
        binary=jailer, uid=UID, gid=GID, chroot_base_dir=tmp_path / "jails", cgroup_version=1
    )
    return FirecrackerDriver(replace(driver.config, jailer=jail_config))


async def test_driver_lifecycle_inside_the_jail(
    jailed_driver: FirecrackerDriver, spec: d.VMSpec, tmp_path: Path, netns: str, shm_dir: Path
) -> None:
    """Memory on /dev/shm, the rest on disk (the node's default layout)."""
    vm = await jailed_driver.boot(spec)
    jails = tmp_path / "jails" / "firecracker"
    try:
        root = jails / vm.id / "root"
        args = json.loads((jails / vm.id / "jailer-args.json").read_text())
        assert (args["uid"], args["gid"], args["netns"]) == (UID, GID, f"/run/netns/{netns}")
        assert f"memory.limit_in_bytes={(spec.memory_mib + 64) << 20}" in args["cgroup"]
        assert args["firecracker_args"][:2] == ["--api-sock", "/api.sock"]
        # Everything Firecracker opens was hard-linked into the jail.
        assert (root / "drives" / "upper").stat().st_ino == spec.disks[1].path.stat().st_ino
        assert (root / "boot" / "vmlinux").read_bytes() == spec.kernel.read_bytes()
        assert (root / "firecracker.log").stat().st_ino == (
            spec.workdir / "firecracker.log"
        ).stat().st_ino
        target = d.SnapshotTarget(directory=tmp_path / "snap", memory_dir=shm_dir)
        snap = await vm.snapshot(target, keep_running=True)
        assert vm.state is d.VMState.RUNNING
    finally:
        await vm.stop()
    assert not (jails / vm.id).exists()
    assert snap.memory_file is not None and page(snap.memory_file, 1) == b"1" * 4096

    clone = await jailed_driver.restore(snap, restore_target(tmp_path, "clone", netns))
    try:
        clone_root = jails / clone.id / "root"
        memory = clone_root / "restore" / "memory.bin"
        assert memory.stat().st_ino == snap.memory_file.stat().st_ino
        if os.stat(shm_dir).st_dev != os.stat(tmp_path).st_dev:
            assert mounts_under(jails.resolve()) == [memory.resolve()]
        layer = tmp_path / "clone" / "layers" / "upper.img"
        assert (clone_root / "drives" / "upper").stat().st_ino == layer.stat().st_ino
        snap2 = await clone.snapshot(snapshot_target(tmp_path, "snap2"), keep_running=False)
    finally:
        await clone.stop()
    assert not (jails / clone.id).exists()
    assert mounts_under(tmp_path.resolve()) == []
    assert snap2.memory_file is not None and page(snap2.memory_file, 2) == b"2" * 4096
    assert list((tmp_path / "clone").iterdir()) == []


async def test_a_jailed_restore_serves_memory_the_node_lacks(
    jailed_driver: FirecrackerDriver, spec: d.VMSpec, tmp_path: Path, netns: str
) -> None:
    """The `Uffd` handler listens inside the jail, on a socket the jailed uid may connect to."""
    async with memory_elsewhere(jailed_driver, spec, tmp_path) as (snap, lazy, _, memory):
        target = replace(restore_target(tmp_path, "vm1", netns), lazy_memory=d.LazyMemory(lazy))
        vm = await jailed_driver.restore(snap, target)
        assert isinstance(vm, FirecrackerVM)
        jail = tmp_path / "jails" / "firecracker" / vm.id
        try:
            socket = jail / "root" / UFFD_SOCKET
            assert (socket.stat().st_uid, socket.stat().st_gid) == (UID, GID)
            assert await touched(vm) == {0: page(memory, 0), PAGE: page(memory, 1)}
        finally:
            await vm.stop()
        assert not jail.exists()


async def test_each_jailed_vm_has_a_uid_of_its_own(
    jailed_driver: FirecrackerDriver, spec: d.VMSpec, tmp_path: Path, netns: str
) -> None:
    uids = JailConfig(uid_base=30000, uid_count=2)
    driver = FirecrackerDriver(replace(jailed_driver.config, jail_uids=uids))
    jails = tmp_path / "jails" / "firecracker"
    vm = await driver.boot(spec)
    snap = await vm.snapshot(snapshot_target(tmp_path, "snap"), keep_running=False)
    await vm.stop()  # its uid is free again
    clones = []
    try:
        for name in ("a", "b"):
            clones.append(await driver.restore(snap, restore_target(tmp_path, name, netns)))
        args = [json.loads((jails / c.id / "jailer-args.json").read_text()) for c in clones]
        assert sorted(a["uid"] for a in args) == [30001, 30002]
        assert {a["gid"] for a in args} == {30000}
        with pytest.raises(d.RestoreError, match="jail uids"):
            await driver.restore(snap, restore_target(tmp_path, "c", netns))
    finally:
        for clone in clones:
            await clone.stop()
