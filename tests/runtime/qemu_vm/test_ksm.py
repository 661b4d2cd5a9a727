"""KSM merges what restored guests hold in common: two clones write the same 30 MiB (different
on every page, equal across the guests) and the host merges their copies. Measured per VMM
(`/proc/<pid>/ksm_stat`) against a baseline taken once KSM has gone over both guests, so pages
the clones had in common already do not count. The host's KSM settings are put back after."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from aenv.runtime.driver import VM
from aenv.runtime.ksm import Ksm, KsmSettings, merged_pages
from aenv.runtime.qemu import QemuVM
from tests.runtime.qemu_vm.conftest import Fleet, Template
from tests.runtime.qemu_vm.netns import agent

pytestmark = pytest.mark.slow
# `seq` output in a guest tmpfs: every page differs from the others, and is the same in both.
WRITE = "mkdir -p /run/ksm && mount -t tmpfs tmpfs /run/ksm && seq 1 3900000 > /run/ksm/seq"
WRITTEN_PAGES = 30 * 256  # 30 MiB
# ksmd scans the whole host (other VMMs too), so this is a bound for a failure, not a timing.
DEADLINE_S = 240.0


@pytest.fixture
def ksm() -> Iterator[Ksm]:
    host = Ksm()
    if not host.available():
        pytest.skip("this kernel has no KSM")
    try:
        yield host
    finally:
        host.restore()


async def run(netns: str, script: str) -> None:
    body = json.dumps({"argv": ["sh", "-c", script], "timeout": 120}).encode()
    result: dict[str, Any] = await agent(netns, "POST", "/run", body=body, limit_s=180)
    assert result["rc"] == 0, result


def pid(vm: VM) -> int:
    assert isinstance(vm, QemuVM)
    return vm.proc.pid


async def scans(ksm: Ksm, count: int) -> None:
    """Wait for ksmd to go over all mergeable memory `count` more times (a page is merged on
    the second pass that finds it unchanged)."""
    start = (await asyncio.to_thread(ksm.stats)).full_scans
    for _ in range(int(DEADLINE_S / 0.5)):
        if (await asyncio.to_thread(ksm.stats)).full_scans >= start + count:
            return
        await asyncio.sleep(0.5)
    raise TimeoutError(f"ksmd did not finish {count} scans in {DEADLINE_S:.0f} s")


async def test_ksm_merges_what_clones_hold_in_common(
    fleet: Fleet, template: Template, ksm: Ksm
) -> None:
    clones = await fleet.restore_many(template.snapshot, 2)
    ksm.enable(KsmSettings(pages_to_scan=4000, sleep_ms=20))
    await scans(ksm, 2)
    before = [merged_pages(pid(vm)) for vm, _ in clones]
    await asyncio.gather(*(run(netns, WRITE) for _, netns in clones))
    await scans(ksm, 3)
    gained = [merged_pages(pid(vm)) - b for (vm, _), b in zip(clones, before, strict=True)]
    # Each guest's copy is merged with the other's; half of it allows for pages the guest
    # kernel moved or had not written back when ksmd passed.
    assert all(g >= WRITTEN_PAGES // 2 for g in gained), (before, gained)
    assert ksm.stats().saved_bytes >= WRITTEN_PAGES * 4096 // 2
