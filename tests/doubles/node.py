"""A node on doubles: the real catalog, template store, snapshot repository, orchestrator and
API, over the double driver and slots, all under one temporary data dir."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.config import Config
from aenv.envd import ENVD_VERSION
from aenv.ids import new_build_id
from aenv.network import Slot
from aenv.orchestrator.catalog import Catalog, SandboxRecord
from aenv.orchestrator.envd_client import EnvdClient, http_client
from aenv.orchestrator.lifecycle import CreateRequest, Orchestrator
from aenv.orchestrator.repository import open_archive
from aenv.orchestrator.templates import Template, TemplateStore
from aenv.runtime.driver import Disk, NetAttachment, SnapshotTarget, VMSpec
from tests.doubles.driver import DoubleDriver, write_disk
from tests.doubles.slots import DoubleSlots
from tests.doubles.volumes import DirectoryBacking
from tests.support.wait import eventually

TEMPLATE_FILES = {"/etc/template": "base", "/etc/hostname": "sandbox\n"}


@dataclass
class DoubleNode:
    config: Config
    catalog: Catalog
    slots: DoubleSlots
    driver: DoubleDriver
    templates: TemplateStore
    orchestrator: Orchestrator
    volume_backing: DirectoryBacking

    def reopen(self) -> DoubleNode:
        """The node as a restarted server finds it (the same data dir, no VMs)."""
        templates = TemplateStore(self.templates.directory, self.templates.memory_dir)
        templates.load()
        catalog = Catalog(self.config.paths.catalog)
        orchestrator = Orchestrator(
            self.config,
            catalog,
            self.driver,
            self.slots,
            templates,
            open_archive(self.config),
            self.volume_backing,
        )
        return DoubleNode(
            self.config,
            catalog,
            self.slots,
            self.driver,
            templates,
            orchestrator,
            self.volume_backing,
        )

    def request(self, **fields: Any) -> CreateRequest:
        values: dict[str, Any] = {"template": "base", "timeout": 300, "metadata": {}}
        return CreateRequest(**{"env_vars": {}, **values, **fields})

    def row(self, sandbox_id: str) -> SandboxRecord:
        """The sandbox's catalog row, which must exist."""
        record = self.catalog.get(sandbox_id)
        assert record is not None, f"no row for {sandbox_id}"
        return record

    def guest(self, sandbox_id: str) -> Any:
        """The running guest of a sandbox (its `Guest`)."""
        return self.vm(sandbox_id).guest

    def vm(self, sandbox_id: str) -> Any:
        """The running VM of a sandbox (its `DoubleVM`)."""
        endpoint = self.orchestrator.guest_endpoint(sandbox_id)
        return self.driver.running[endpoint.incarnation]


@asynccontextmanager
async def double_node(
    home: Path, slots: DoubleSlots | None = None, **settings: Any
) -> AsyncIterator[DoubleNode]:
    """A started node with template `base` (on `slots`, new double slots by default); on exit
    every sandbox is killed and the node closed (the test then checks nothing leaked)."""
    config = Config(home=home, **{"pause_on_shutdown": False, **settings})
    paths = config.paths
    slots = slots or DoubleSlots()
    driver = DoubleDriver(slots)
    templates = TemplateStore(paths.templates, home / "shm")
    templates.load()
    catalog = Catalog(paths.catalog)
    await make_template(driver, slots, templates, "base")
    backing = DirectoryBacking(paths.volumes)
    orchestrator = Orchestrator(
        config, catalog, driver, slots, templates, open_archive(config), backing
    )
    node = DoubleNode(config, catalog, slots, driver, templates, orchestrator, backing)
    await orchestrator.start()
    try:
        yield node
    finally:
        await node.orchestrator.close()
        node.catalog.close()
        for vm in list(driver.running.values()):
            await vm.stop()
        for netns in list(slots.in_use):
            await slots.release(slots.in_use[netns])


async def make_template(
    driver: DoubleDriver, slots: DoubleSlots, store: TemplateStore, template_id: str
) -> Template:
    """A template as `build_template` makes one: boot, `/init` with the template's token,
    snapshot into the template's directory, `template.json` last."""
    build = store.directory / template_id / "build"
    snapshot_dir = store.directory / template_id / "snapshot"
    memory = store.memory_dir / template_id
    # The shared read-only guest images, as `prepare_images` publishes them.
    images = store.directory.parent / "cache" / "images"
    for directory in (build, snapshot_dir, memory, images):
        directory.mkdir(parents=True, exist_ok=True)
    for name in ("root.img", "envd.img", "kernel"):
        (images / name).write_bytes(b"\0" * 512)
    slot: Slot = await slots.acquire()
    spec = VMSpec(
        vcpus=1,
        memory_mib=512,
        kernel=images / "kernel",
        cmdline="console=ttyS0",
        workdir=build,
        disks=(
            Disk("root", images / "root.img", read_only=True),
            Disk("upper", write_disk(build / "upper.img", TEMPLATE_FILES)),
            Disk("envd", images / "envd.img", read_only=True),
        ),
        net=NetAttachment(slot.netns, slot.guest.tap, slot.guest.mac),
        memory_dir=memory,
    )
    token = secrets.token_hex(8)
    try:
        vm = await driver.boot(spec)
        async with http_client() as http:
            envd = EnvdClient(http, str(slot.address))
            await envd.wait_healthy(10)
            await envd.init(new_token=token, env_vars={}, hostname="sandbox", timeout=10)
        snapshot = await vm.snapshot(SnapshotTarget(snapshot_dir, memory), keep_running=False)
        snapshot.save_manifest()
    finally:
        await slots.release(slot)
    template = Template(
        template_id=template_id,
        build_id=new_build_id(),
        aliases=(template_id,),
        cpu_count=1,
        memory_mb=512,
        disk_size_mb=2048,
        envd_version=ENVD_VERSION,
        envd_access_token=token,
        created_at=time.time(),
        snapshot_dir=str(snapshot_dir),
    )
    store.save(template)
    return template


async def resumed_with_a_copy(node: DoubleNode) -> str:
    """A sandbox whose `/data` was "one" when it was paused (and that checkpoint copied to the
    repository), resumed, and now "two"; its id."""
    record, _ = await node.orchestrator.create(node.request())
    node.guest(record.id).write("/data", "one")
    await node.orchestrator.pause(record.id)
    await eventually(lambda: node.row(record.id).archived is not None)
    await node.orchestrator.resume(record.id, 60)
    node.guest(record.id).write("/data", "two")
    return record.id


def assert_clean(node: DoubleNode) -> None:
    """Nothing of a removed sandbox is left: no VM, no slot, no files."""
    assert node.driver.running == {}
    assert node.slots.in_use == {}
    sandboxes = node.config.paths.sandboxes
    assert not sandboxes.exists() or list(sandboxes.iterdir()) == []
