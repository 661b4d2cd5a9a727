"""Volumes in restored VMs: every booted VM has `share_slots` 9p devices, so a VM restored from
its snapshot mounts host directories (volumes) without a boot. Two restored VMs see each other's
writes through one directory; an unused slot exports nothing and is read-only; a VM cannot be
saved while a share is mounted, and can once it is unmounted; more shares than slots, or shares
under other tags, are refused and start nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from aenv.runtime.driver import RestoreError, Share, SnapshotError, share_tag
from aenv.runtime.qemu import SHARE_SLOTS
from tests.runtime.qemu_vm.conftest import TEMPLATE_MEMORY, Fleet, Places, Template
from tests.runtime.qemu_vm.netns import agent

pytestmark = pytest.mark.slow

MOUNT = "mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144"


async def sh(netns: str, script: str) -> dict[str, Any]:
    body = json.dumps({"argv": ["sh", "-c", script], "timeout": 100}).encode()
    result: dict[str, Any] = await agent(netns, "POST", "/run", body=body, limit_s=120)
    return result


def volume(places: Places, name: str) -> Path:
    path = places.work / name
    path.mkdir()
    return path


async def test_restored_vms_mount_one_volume_and_see_each_others_writes(
    fleet: Fleet, template: Template, places: Places
) -> None:
    assert template.snapshot.spec.share_slots == SHARE_SLOTS
    shared = volume(places, "shared")
    shares = (Share(share_tag(0), shared),)
    (_, a), (_, b) = [await fleet.restore(template.snapshot, shares) for _ in range(2)]
    for netns in (a, b):
        assert (await sh(netns, f"mkdir -p /mnt/v && {MOUNT} {share_tag(0)} /mnt/v"))["rc"] == 0
    assert (await sh(a, "echo from-a > /mnt/v/note"))["rc"] == 0
    assert (await sh(b, "cat /mnt/v/note"))["stdout"] == "from-a\n"
    assert (shared / "note").read_text() == "from-a\n"
    # The next slot is there, empty and read-only.
    unused = await sh(a, f"mkdir -p /mnt/u && {MOUNT} {share_tag(1)} /mnt/u && ls -A /mnt/u")
    assert unused["rc"] == 0 and unused["stdout"] == "", unused
    assert (await sh(a, "touch /mnt/u/x"))["rc"] != 0


async def test_a_mounted_share_blocks_saving_until_unmounted(
    fleet: Fleet, template: Template, places: Places
) -> None:
    shares = (Share(share_tag(0), volume(places, "blocks")),)
    vm, netns = await fleet.restore(template.snapshot, shares)
    assert (await sh(netns, f"mkdir -p /mnt/v && {MOUNT} {share_tag(0)} /mnt/v"))["rc"] == 0
    with pytest.raises(SnapshotError, match=r"(?i)9p|virtfs|migrat"):
        await vm.snapshot(places.snapshot_target(), keep_running=True)
    assert vm.state.value == "running"
    assert (await sh(netns, "echo still-running > /mnt/v/after"))["rc"] == 0
    assert (await sh(netns, "umount /mnt/v"))["rc"] == 0
    saved = await vm.snapshot(places.snapshot_target(), keep_running=True)
    assert saved.spec.share_slots == SHARE_SLOTS
    assert (await agent(netns))["memory"] == TEMPLATE_MEMORY


async def test_more_shares_than_slots_or_other_tags_are_refused(
    fleet: Fleet, template: Template, places: Places
) -> None:
    directory = volume(places, "refused")
    too_many = tuple(Share(share_tag(i), directory) for i in range(SHARE_SLOTS + 1))
    with pytest.raises(RestoreError, match="share slots"):
        await fleet.restore(template.snapshot, too_many)
    with pytest.raises(RestoreError, match="tags"):
        await fleet.restore(template.snapshot, (Share("other", directory),))
