"""A guest gives the host back the disk it frees: deleting a file in the guest punches holes in
its writable qcow2 top (the guest mounts its layer with `discard`, QEMU passes it through), and
zeros it writes take no space (`detect-zeroes=unmap`). Measured on the host file itself."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aenv.runtime import qcow2
from aenv.runtime.driver import VM
from aenv.runtime.qemu import QemuDriver, QemuVM
from aenv.storage import layers
from tests.runtime.qemu_vm.conftest import Fleet, Places, Template
from tests.runtime.qemu_vm.netns import NetnsPool, agent, wait_ready

pytestmark = pytest.mark.slow
WRITE_MIB = 96
SLACK_MIB = 16  # qcow2 metadata and what the guest's journal writes meanwhile
BIG = "/home/user/big"


@pytest.fixture
async def discardless_fleet(
    driver: QemuDriver, places: Places, nets: NetnsPool, template: Template, no_leaks: None
) -> AsyncIterator[Fleet]:
    config = dataclasses.replace(driver.config, discard=False)
    fleet = Fleet(QemuDriver(config, cgroups=driver.launcher.cgroups), places, nets)
    try:
        yield fleet
    finally:
        await fleet.stop_all()


async def run(netns: str, script: str) -> dict[str, Any]:
    body = json.dumps({"argv": ["sh", "-c", script], "timeout": 200}).encode()
    result: dict[str, Any] = await agent(netns, "POST", "/run", body=body, limit_s=240)
    assert result["rc"] == 0, result
    return result


def top(vm: VM) -> Path:
    assert isinstance(vm, QemuVM)
    (upper,) = [d.path for d in vm.spec.disks if d.drive_id == "upper"]
    return upper


def allocated_mib(vm: VM) -> float:
    return layers.allocated_bytes(top(vm)) / (1 << 20)


async def test_deleted_files_and_zeros_give_the_host_disk_back(
    fleet: Fleet, template: Template
) -> None:
    vm, netns = await fleet.restore(template.snapshot)
    await wait_ready(netns)
    before = allocated_mib(vm)
    # Non-zero data (0x5a): zeros would be unmapped on the way in.
    fill = f"head -c {WRITE_MIB}M /dev/zero | tr '\\000' 'Z' > {BIG} && sync"
    await run(netns, fill)
    written = allocated_mib(vm)
    assert written >= before + WRITE_MIB - SLACK_MIB
    await run(netns, f"rm {BIG} && sync")
    freed = allocated_mib(vm)
    assert freed <= before + SLACK_MIB, (before, written, freed)
    await run(netns, f"head -c {WRITE_MIB}M /dev/zero > {BIG} && sync")
    zeros = allocated_mib(vm)
    assert zeros <= before + SLACK_MIB, (before, zeros)
    # The guest's view is intact: the zeros read back, the template's files are still there.
    out = await run(netns, f"cmp -n {WRITE_MIB << 20} {BIG} /dev/zero && cat /home/user/note")
    assert out["stdout"] == "written-to-disk"


async def test_without_discard_the_host_keeps_what_the_guest_freed(
    discardless_fleet: Fleet, template: Template
) -> None:
    """The baseline the test above differs from: the same steps leave the space allocated."""
    vm, netns = await discardless_fleet.restore(template.snapshot)
    await wait_ready(netns)
    before = allocated_mib(vm)
    fill = f"head -c {WRITE_MIB}M /dev/zero | tr '\\000' 'Z' > {BIG} && sync"
    await run(netns, fill)
    await run(netns, f"rm {BIG} && sync")
    assert allocated_mib(vm) >= before + WRITE_MIB - SLACK_MIB


async def test_a_vm_that_kept_running_after_a_snapshot_still_gives_disk_back(
    fleet: Fleet, template: Template, places: Places
) -> None:
    """A snapshot that keeps the VM running moves it onto a new top (`blockdev-snapshot-sync`):
    that top passes discards and unmaps zeros too."""
    vm, netns = await fleet.restore(template.snapshot)
    await wait_ready(netns)
    snap = await vm.snapshot(places.snapshot_target(), keep_running=True)
    # The new top's header names the sealed layer, not the file in the VM's workdir.
    assert qcow2.chain(top(vm))[1] == snap.disks["upper"]
    before = allocated_mib(vm)
    fill = f"head -c {WRITE_MIB}M /dev/zero | tr '\\000' 'Z' > {BIG} && sync"
    await run(netns, fill)
    assert allocated_mib(vm) >= before + WRITE_MIB - SLACK_MIB
    await run(netns, f"rm {BIG} && sync")
    assert allocated_mib(vm) <= before + SLACK_MIB
    await run(netns, f"head -c {WRITE_MIB}M /dev/zero > {BIG} && sync")
    assert allocated_mib(vm) <= before + SLACK_MIB
