"""Creates and forks count the disk their sandboxes can use (each one's writable layer is bounded
at its disk size) against the free space of the node's data filesystem above its reserve, and are
refused with 429 naming the disk before anything starts. The node's home is a tmpfs of a known
size made for the test (tmpfs allocates nothing until written), so the free space is exact."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from aenv.orchestrator.lifecycle import CapacityReached
from aenv.orchestrator.states import SandboxState
from tests.doubles.node import assert_clean, double_node

FS_MIB = 8192
# The template's disk is 2048 MiB and the reserve 1024 MiB: three sandboxes fit, four do not.
FITS = 3
API_KEY = "e2b_" + "7" * 40


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    mountpoint = tmp_path / "fs"
    mountpoint.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={FS_MIB}m,mode=0700", "aenv-test", mountpoint],
        check=True,
    )
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "--lazy", mountpoint], check=True)


async def test_a_fork_that_cannot_fit_is_refused_before_its_checkpoint(home: Path) -> None:
    async with double_node(home, reserve_disk_mb=1024) as node:
        orc = node.orchestrator
        parent, _ = await orc.create(node.request())
        snapshots = node.driver.calls["snapshot"]
        with pytest.raises(CapacityReached, match=r"not enough disk: .* 8192 MiB"):
            await orc.fork(parent.id, FITS + 1, 60)
        assert node.driver.calls["snapshot"] == snapshots  # nothing was saved or started
        assert [r.id for r in node.catalog.list()] == [parent.id]
        assert node.row(parent.id).state is SandboxState.RUNNING
        children = await orc.fork(parent.id, FITS, 60)
        assert all(not isinstance(c, BaseException) for c in children), children
        for record in orc.list():
            await orc.kill(record.id)
        assert_clean(node)


async def test_creates_starting_together_count_each_other(home: Path) -> None:
    # Room for one 2048 MiB disk above the reserve, not two.
    reserve = FS_MIB - 2048 - 1000
    async with double_node(home, reserve_disk_mb=reserve, max_concurrent_creates=2) as node:
        orc = node.orchestrator
        hold = node.driver.hold("restore")
        first = asyncio.create_task(orc.create(node.request()))
        await hold.reached.wait()
        with pytest.raises(CapacityReached, match="not enough disk"):
            await orc.create(node.request())
        hold.release()
        await first
        # Once running, a sandbox's thin disk holds what it wrote: the next create fits.
        await orc.create(node.request())
        for record in orc.list():
            await orc.kill(record.id)
        assert_clean(node)


async def test_queued_creates_hold_no_disk(home: Path) -> None:
    # One create at a time: the ones waiting in the queue are not counted, so a burst larger
    # than the free space over the disk size is admitted one by one.
    async with double_node(home, reserve_disk_mb=1024, max_concurrent_creates=1) as node:
        orc = node.orchestrator
        created = await asyncio.gather(*(orc.create(node.request()) for _ in range(FITS + 2)))
        assert len(created) == FITS + 2
        for record in orc.list():
            await orc.kill(record.id)
        assert_clean(node)


async def test_the_api_answers_429_naming_the_disk(home: Path) -> None:
    async with double_node(home, reserve_disk_mb=FS_MIB) as node:
        keys = KeyStore(home / "api-keys.json")
        keys.add(API_KEY, "test")
        app = create_api(node.orchestrator, node.config, keys)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://node", headers={"X-API-KEY": API_KEY}
        ) as client:
            created = await client.post("/sandboxes", json={"templateID": "base"})
            assert created.status_code == 429, created.text
            body = created.json()
            assert body["code"] == 429 and "disk" in body["message"]
            node.orchestrator.config = node.config.model_copy(update={"reserve_disk_mb": 1024})
            parent = (await client.post("/sandboxes", json={"templateID": "base"})).json()
            fork = await client.post(
                f"/sandboxes/{parent['sandboxID']}/fork", json={"count": FITS + 1}
            )
            assert fork.status_code == 429, fork.text
            assert fork.json()["code"] == 429 and "not enough disk" in fork.json()["message"]
        assert [r.id for r in node.catalog.list()] == [parent["sandboxID"]]
