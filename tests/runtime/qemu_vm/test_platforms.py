"""A template saved by an older driver keeps working: a snapshot taken on the CPU model TCG
guests had before (`max`, with 5-level paging) restores on that model, runs, and its own
snapshots keep naming it; today's template runs on today's model."""

from __future__ import annotations

import json

import pytest

from aenv.runtime.cgroups import CgroupManager
from aenv.runtime.qemu import LEGACY_TCG_CPU, TCG_CPU, QemuDriver, QemuVM
from tests.runtime.qemu_vm.conftest import Fleet, Images, Places, Template, boot_template
from tests.runtime.qemu_vm.netns import NetnsPool, agent, wait_ready

pytestmark = pytest.mark.slow


async def cpu_flags(netns: str) -> list[str]:
    body = json.dumps({"argv": ["grep", "-m1", "^flags", "/proc/cpuinfo"], "timeout": 60})
    result = await agent(netns, "POST", "/run", body=body.encode(), limit_s=120)
    assert result["rc"] == 0, result
    flags: list[str] = result["stdout"].split(":", 1)[1].split()
    return flags


async def test_a_template_of_the_older_cpu_model_restores_on_it(
    driver: QemuDriver,
    cgroups: CgroupManager,
    images: Images,
    places: Places,
    nets: NetnsPool,
    fleet: Fleet,
    template: Template,
) -> None:
    if driver.config.accel != "tcg":
        pytest.skip("the older CPU model is TCG's")
    older = QemuDriver(driver.config, cgroups=cgroups)
    older._platforms = older._platforms[1:]  # what a driver before 4-level paging booted
    assert older._platforms[0].cpu == LEGACY_TCG_CPU
    vm, netns = await boot_template(older, images, places, nets)
    try:
        await wait_ready(netns)
        assert "la57" in await cpu_flags(netns)
        await agent(netns, "POST", "/?memory=older&note=older-note")
        snap = await vm.snapshot(places.snapshot_target(), keep_running=False)
    finally:
        await vm.stop()
    assert snap.compat == await driver.compat_on(older._platforms[0]) != await driver.compat()

    restored, restored_netns = await fleet.restore(snap)
    assert isinstance(restored, QemuVM) and restored.platform == older._platforms[0]
    state = await agent(restored_netns)
    assert (state["memory"], state["note"]) == ("older", "older-note")
    assert "la57" in await cpu_flags(restored_netns)
    again = await restored.snapshot(places.snapshot_target(), keep_running=True)
    assert again.compat == snap.compat

    current, current_netns = await fleet.restore(template.snapshot)
    assert isinstance(current, QemuVM) and current.platform.cpu == TCG_CPU
    assert "la57" not in await cpu_flags(current_netns)
