"""Volumes in real guests, with the unmodified Python SDK: one volume mounted by two sandboxes
at once, each seeing the other's writes; its files outlive both and reach a third sandbox, and
its forks, and survive its pause, which keeps the sandbox's processes unless a volume is in
use (a snapshot of it carries no volume); mounted, it cannot be deleted. A volume is bounded by
its size (ENOSPC, `df`), and what one sandbox's root plants in it (a set-uid root binary, a
device node) gives another sandbox's user neither root nor the device. Leaves volume `kept`
with a file for test_after_restart.py."""

from __future__ import annotations

import os

import httpx
import pytest
from e2b import CommandExitException, Sandbox, SandboxException, Volume, VolumeException

from tests.e2e.inner.conftest import BASE, LIFETIME

USER_FILE = "/mnt/data/from-a"


def test_two_sandboxes_share_a_volume_that_outlives_them() -> None:
    volume = Volume.create("shared")
    a = Sandbox.create(timeout=LIFETIME, volume_mounts={"/mnt/data": volume})
    b = Sandbox.create(timeout=LIFETIME, volume_mounts={"/mnt/data": "shared"})
    try:
        assert "9p" in a.commands.run("grep ' /mnt/data ' /proc/mounts").stdout
        # A command as the default user, and envd's file API, on the same files.
        a.commands.run(f"echo hello from a > {USER_FILE}")
        assert b.files.read(USER_FILE) == "hello from a\n"
        b.files.write("/mnt/data/dir/from-b", "written by b")
        assert a.commands.run("cat /mnt/data/dir/from-b").stdout == "written by b"
        b.commands.run("rm /mnt/data/dir/from-b")
        assert not a.files.exists("/mnt/data/dir/from-b")
        with pytest.raises(VolumeException, match="is mounted by sandbox"):
            Volume.destroy(volume.volume_id)
    finally:
        a.kill()
        b.kill()
    c = Sandbox.create(timeout=LIFETIME, volume_mounts={"/data": volume})
    try:
        assert c.files.read("/data/from-a") == "hello from a\n"
    finally:
        c.kill()
    assert Volume.destroy(volume.volume_id) is True
    assert [v.name for v in Volume.list()] == []


def test_pause_resume_and_fork_keep_the_volume_and_the_processes() -> None:
    volume = Volume.create("kept")
    sandbox = Sandbox.create(timeout=LIFETIME, volume_mounts={"/kept": volume})
    children: list[Sandbox] = []
    try:
        sandbox.files.write("/kept/note", "before the pause")
        sandbox.files.write("/home/user/own", "on the sandbox's disk")
        sleeper = sandbox.commands.run("sleep 3600", background=True).pid
        alive = f"grep -q 3600 /proc/{sleeper}/cmdline"  # fails once the process is gone
        sandbox.pause()
        resumed = Sandbox.connect(sandbox.sandbox_id, timeout=LIFETIME)
        assert resumed.files.read("/kept/note") == "before the pause"
        assert resumed.files.read("/home/user/own") == "on the sandbox's disk"
        # Saved with its memory (the guest unmounted the volume for the save): its process
        # lives on, and the volume is mounted again where it was.
        resumed.commands.run(alive)
        assert "9p" in resumed.commands.run("grep ' /kept ' /proc/mounts").stdout
        (child,) = resumed.fork(count=1, timeout=LIFETIME)
        assert isinstance(child, Sandbox), child
        children.append(child)
        child.commands.run(alive)
        child.files.write("/kept/from-child", "child")
        assert resumed.files.read("/kept/from-child") == "child"
        # A snapshot carries no volume: a sandbox from it has a plain directory at the path
        # (and the process, restored with the memory).
        info = resumed.create_snapshot()
        bare = Sandbox.create(info.snapshot_id, timeout=LIFETIME)
        children.append(bare)
        assert bare.commands.run("grep ' /kept ' /proc/mounts || echo none").stdout == "none\n"
        bare.commands.run(alive)
        # A volume in use (the working directory of a process) cannot be unmounted: the pause
        # saves the filesystem alone, and the sandbox boots again with its files.
        holding = "cd /kept && touch /tmp/holding && exec sleep 3600"
        resumed.commands.run(holding, background=True)
        resumed.commands.run("while [ ! -e /tmp/holding ]; do sleep 0.05; done", timeout=120)
        resumed.pause()
        again = Sandbox.connect(sandbox.sandbox_id, timeout=LIFETIME)
        assert again.files.read("/kept/from-child") == "child"
        assert again.files.read("/home/user/own") == "on the sandbox's disk"
        with pytest.raises(CommandExitException):
            again.commands.run(alive)
    finally:
        for s in [sandbox, *children]:
            s.kill()


SIZE_MB = 32
# Root in one sandbox: a set-uid root copy of `id`, and a node of the guest's own disk that
# anyone may read.
_PLANT_PRIVILEGE = """set -e
cp /usr/bin/id /mnt/b/id && chmod 4755 /mnt/b/id
disk=$(ls /sys/block | grep -m1 '^vd')
IFS=: read major minor < /sys/block/$disk/dev
mknod -m 666 /mnt/b/disk b "$major" "$minor"
"""


def test_a_volume_is_bounded_and_grants_no_privilege() -> None:
    key = {"X-API-Key": os.environ["E2B_API_KEY"]}
    made = httpx.post(f"{BASE}/volumes", json={"name": "bounded", "sizeMB": SIZE_MB}, headers=key)
    assert made.status_code == 201, made.text
    volume_id, token = made.json()["volumeID"], made.json()["token"]
    planter = Sandbox.create(timeout=LIFETIME, volume_mounts={"/mnt/b": "bounded"})
    other = Sandbox.create(timeout=LIFETIME, volume_mounts={"/mnt/b": "bounded"})
    try:
        # The guest's df sees the volume's own filesystem, less its ext4 metadata.
        size_kb, used_kb = other.commands.run(
            "df -k --output=size,used /mnt/b | tail -1"
        ).stdout.split()
        assert SIZE_MB * 768 <= int(size_kb) <= SIZE_MB * 1024 and int(used_kb) < SIZE_MB * 256
        with pytest.raises(CommandExitException) as full:
            other.commands.run(f"dd if=/dev/zero of=/mnt/b/fill bs=1M count={SIZE_MB * 2}")
        assert "No space left on device" in full.value.stderr
        other.commands.run("rm /mnt/b/fill")
        # An upload past the volume's free space is refused before anything is written.
        upload = httpx.put(
            f"{BASE}/volumecontent/{volume_id}/file",
            params={"path": "/big"},
            content=b"\0" * (SIZE_MB << 20),
            headers={"Authorization": f"Bearer {token}"},
        )
        assert upload.status_code == 507, upload.text

        planter.commands.run(_PLANT_PRIVILEGE, user="root")
        assert other.commands.run("stat -c %a /mnt/b/id").stdout.strip() == "4755"
        own_uid = other.commands.run("id -u").stdout.strip()
        assert own_uid != "0"
        assert other.commands.run("/mnt/b/id -u").stdout.strip() == own_uid
        with pytest.raises(CommandExitException) as denied:
            other.commands.run("head -c 512 /mnt/b/disk > /dev/null")
        assert "Permission denied" in denied.value.stderr
        mount = other.commands.run("grep ' /mnt/b ' /proc/mounts").stdout
        assert "nosuid" in mount and "nodev" in mount, mount
    finally:
        planter.kill()
        other.kill()
    assert Volume.destroy(volume_id) is True


def test_bad_mounts_are_refused_by_the_sdk() -> None:
    with pytest.raises(SandboxException, match="volume 'missing' not found"):
        Sandbox.create(volume_mounts={"/mnt/x": "missing"})
    with pytest.raises(SandboxException, match="must be an absolute path"):
        Sandbox.create(volume_mounts={"data": "kept"})
    with pytest.raises(VolumeException, match="already exists"):
        Volume.create("kept")
