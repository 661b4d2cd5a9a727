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
from tests.doubles.node import assert_clean, double_node, eventually

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


async def test_concurrent_creates_count_each_other(home: Path) -> None:
    # One create at a time: the others wait in the queue, their disks already counted.
    async with double_node(home, reserve_disk_mb=1024, max_concurrent_creates=1) as node:
        orc = node.orchestrator
        hold = node.driver.hold("restore")
        first = asyncio.create_task(orc.create(node.request()))
        await hold.reached.wait()
        rest = [asyncio.create_task(orc.create(node.request())) for _ in range(FITS)]
        # Every create has been admitted (and waits in the queue) or refused.
        await eventually(lambda: sum(t.done() for t in rest) + orc.stats.queued == FITS)
        refused = [t for t in rest if t.done()]
        assert len(refused) == 1
        with pytest.raises(CapacityReached, match="not enough disk"):
            await refused[0]
        hold.release()
        await first
        await asyncio.gather(*(t for t in rest if t is not refused[0]))
        assert len(orc.list()) == FITS
        # The creates are done: their disks count as the free space they use from now on.
        await orc.create(node.request())
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
