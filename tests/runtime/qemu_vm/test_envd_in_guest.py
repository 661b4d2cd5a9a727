"""The real envd bundle in our guest: the init mounts it at /opt/aenv and starts it, and after a
restore envd's `/init` (host entropy) makes clones of one snapshot draw different random numbers.
Without it they do not: two clones read the same sequence of kernel UUIDs (observed here).

The envd bundle is the test servers' (`tests.support.guest.envd_bundle`): built by the first
suite that needs it (minutes), then shared.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import time
from collections.abc import AsyncIterator

import pytest

from aenv.guest.bundle import build_envd_drive
from aenv.runtime.driver import Snapshot
from aenv.runtime.qemu import QemuDriver
from tests.runtime.qemu_vm.conftest import Fleet, Images, Places, boot_template
from tests.runtime.qemu_vm.netns import NetnsPool, http
from tests.support.guest import envd_bundle

pytestmark = pytest.mark.slow
UUID = "/files?path=/proc/sys/kernel/random/uuid"


async def wait_healthy(netns: str, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if (await http(netns, "GET", "/health", connect_limit_s=0.5))[0] == 204:
                return
        except OSError:
            pass
        await asyncio.sleep(0.05)
    raise TimeoutError(f"envd in {netns} not healthy after {limit_s:.0f}s")


async def kernel_uuid(netns: str) -> str:
    # /proc files report size 0, so ask for the streamed (gzip) variant of the download.
    status, body = await http(netns, "GET", UUID, headers={"Accept-Encoding": "gzip"})
    assert status == 200, body
    return gzip.decompress(body).decode().strip()


@pytest.fixture(scope="module")
async def envd_snapshot(
    driver: QemuDriver, images: Images, places: Places, nets: NetnsPool
) -> AsyncIterator[Snapshot]:
    bundle = await asyncio.to_thread(envd_bundle)
    drive = await build_envd_drive(bundle, places.vm_dir() / "envd.ext4")
    real = Images(images.kernel, images.initrd, images.rootfs, drive)
    vm, netns = await boot_template(driver, real, places, nets)
    try:
        try:
            await wait_healthy(netns)
        except TimeoutError as exc:
            console = vm.console_log.read_text(errors="replace")[-3000:]
            raise TimeoutError(f"{exc}; guest console:\n{console}") from exc
        snap = await vm.snapshot(places.snapshot_target(), keep_running=False)
    finally:
        await vm.stop()
    assert drive in [d.path for d in snap.spec.disks]
    yield snap


async def test_clones_diverge_after_envd_init(fleet: Fleet, envd_snapshot: Snapshot) -> None:
    clones = await fleet.restore_many(envd_snapshot, 2)
    netnss = [netns for _, netns in clones]
    await asyncio.gather(*(wait_healthy(n) for n in netnss))
    for netns in netnss:
        entropy = base64.b64encode(os.urandom(64)).decode()
        body = json.dumps({"entropy": entropy, "hostname": netns}).encode()
        status, reply = await http(
            netns, "POST", "/init", body=body, headers={"Content-Type": "application/json"}
        )
        assert status == 204, reply
    uuids = [await kernel_uuid(n) for n in netnss for _ in range(2)]
    assert len(set(uuids)) == 4, uuids
