"""The Firecracker path end to end through the orchestrator, on the Firecracker double. Run by
`test_firecracker_orchestrator.py` in a network namespace of its own, which plays the host: the
slots' veths, nft table and forwarding never touch the real host's network.

Firecracker cannot run here (no usable KVM). Its double is `fc_peer.py` run as the `firecracker`
binary, with a guest (`fc_guest.py`: a real envd behind the VM's tap, its files on the VM's
writable drive): it checks every request against Firecracker's swagger and call order, reads the
drives it is given as raw images (a qcow2 is refused), writes and reads its snapshot file pair,
and, jailed, sees only what the jailer's layout gives it. Everything else is real: the orchestrator,
the driver, network slots, cgroups, the catalog, the snapshot repository, envd.

One scenario walks the lifecycle: a template build, creates, pauses with and without memory,
resumes, a snapshot, a fork, and a restart of the orchestrator. A file written in the first
sandbox must be read back after every step, so it must have travelled through every disk image
the driver sealed, copied and exported. Another runs a template build with steps at another
size; a third shows that a qcow2 never reaches Firecracker. Each runs direct and jailed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from ipaddress import IPv4Network
from pathlib import Path

import httpx
import pytest

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from aenv.config import Config
from aenv.guest.cmdline import GuestNet
from aenv.mounts import mounts_under
from aenv.network import NetworkConfig, SlotPool
from aenv.orchestrator.build_records import BuildSpec, BuildStatus, Step
from aenv.orchestrator.build_steps import StepType
from aenv.orchestrator.builds import Builder
from aenv.orchestrator.catalog import Catalog
from aenv.orchestrator.images import GuestImages
from aenv.orchestrator.kinds import SaveMode
from aenv.orchestrator.lifecycle import CreateFailed, CreateRequest, Orchestrator
from aenv.orchestrator.repository import open_archive
from aenv.orchestrator.tags import TagStore
from aenv.orchestrator.templates import BuildRequest, Template, TemplateStore, build_template
from aenv.runtime.cgroups import CgroupManager
from aenv.runtime.firecracker import FirecrackerConfig, FirecrackerDriver
from aenv.runtime.firecracker.driver import NO_SHARES
from aenv.runtime.firecracker.jailer import JailerConfig
from aenv.runtime.qcow2 import is_qcow2
from aenv.storage import layers
from tests.runtime.firecracker import fc_peer
from tests.runtime.firecracker.fc_support import alive

REPO = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
ENVD_PORT = 49983
API_KEY = "e2b_" + "fc" * 20
NOTE = "/home/user/note.txt"

IN_NETNS = "AENV_TEST_FC_NETNS"
# Each test's slots get addresses no earlier test used: HTTP clients pool connections by address
# (pyqwest's pool is process-wide), and one to an earlier test's guest would be reset.
SLOT_NETWORKS = (IPv4Network(f"10.210.{n}.0/24") for n in itertools.count())
pytestmark = pytest.mark.skipif(
    os.environ.get(IN_NETNS) != "1", reason="run by test_firecracker_orchestrator.py"
)


@pytest.fixture
def fc_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    binary = tmp_path_factory.mktemp("bin") / "firecracker"
    binary.write_text(
        f"#!/bin/sh\n{fc_peer.GUEST_ENV}=1 PYTHONPATH={REPO} "
        f'exec {sys.executable} -m {fc_peer.__name__} "$@"\n'
    )
    binary.chmod(0o755)
    return binary


@pytest.fixture(params=["direct", "jailed"])
def placement(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    """How Firecracker is placed, and the directory the node's home, images and jails go to.
    The default layout either way: home and jails on disk, guest memory on tmpfs (`Paths.memory`),
    so a jailed VM gets its memory files through bind mounts and its disks through hard links."""
    return request.param, tmp_path


@pytest.fixture
def fc_config(placement: tuple[str, Path], fc_binary: Path) -> FirecrackerConfig:
    # The double's guest (envd and what it runs) lives in the VMM's cgroup: room for it.
    config = FirecrackerConfig(
        binary=fc_binary, ready_timeout_s=30, vsock_cid=3, vmm_overhead_mib=1024, pids_base=256
    )
    how, base = placement
    if how == "direct":
        return config
    jailer = base / "jailer"
    jailer.write_text(f'#!/bin/sh\nexec {sys.executable} {HERE / "fake_jailer.py"} "$@"\n')
    jailer.chmod(0o755)
    return replace(
        config,
        jailer=JailerConfig(binary=jailer, uid=0, gid=0, chroot_base_dir=base / "jails"),
    )


@dataclass
class Node:
    """What `aenv server` wires together, minus the HTTP front."""

    config: Config
    driver: FirecrackerDriver
    slots: SlotPool
    templates: TemplateStore
    catalog: Catalog
    orchestrator: Orchestrator

    async def close(self) -> None:
        await self.orchestrator.close()
        self.catalog.close()


async def start_node(config: Config, driver: FirecrackerDriver, slots: SlotPool) -> Node:
    templates = TemplateStore(config.paths.templates, config.paths.memory)
    templates.load()
    catalog = Catalog(config.paths.catalog)
    orchestrator = Orchestrator(config, catalog, driver, slots, templates, open_archive(config))
    await orchestrator.start()
    return Node(config, driver, slots, templates, catalog, orchestrator)


@pytest.fixture
async def world(
    placement: tuple[str, Path], fc_config: FirecrackerConfig, cgroups: CgroupManager
) -> AsyncIterator[tuple[Config, FirecrackerDriver, SlotPool, GuestImages]]:
    prefix = f"fct{secrets.token_hex(2)}"
    config = Config(
        home=placement[1] / "home",
        driver="firecracker",
        sandbox_memory_mb=8,  # the double writes memory files of this size
        sandbox_disk_mb=64,
        network_prefix=prefix,
        warm_slots_low=0,
        warm_slots_high=0,
    )
    slots = SlotPool(
        NetworkConfig(
            prefix=prefix,
            slot_network=next(SLOT_NETWORKS),
            pool_low=0,
            pool_high=0,
        )
    )
    await slots.start()
    images = placement[1] / "images"
    images.mkdir()
    for name, content in {
        "kernel.bzImage": b"MZ compressed kernel",
        "vmlinux": b"\x7fELF kernel",
        "initrd.cpio.gz": b"initrd",
        "rootfs.ext4": b"raw root filesystem",
        "envd.ext4": b"raw envd drive",
    }.items():
        (images / name).write_bytes(content)
    driver = FirecrackerDriver(fc_config, cgroups)
    guest_images = GuestImages(
        kernel=images / "kernel.bzImage",
        vmlinux=images / "vmlinux",
        initrd=images / "initrd.cpio.gz",
        rootfs=images / "rootfs.ext4",
        envd_drive=images / "envd.ext4",
    ).booted_by(driver)
    try:
        yield config, driver, slots, guest_images
    finally:
        for pid in doubles_in(placement[1]):  # what a failed test left running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await slots.close()
        shutil.rmtree(config.paths.memory, ignore_errors=True)


async def build_base(
    config: Config, driver: FirecrackerDriver, slots: SlotPool, images: GuestImages
) -> Template:
    templates = TemplateStore(config.paths.templates, config.paths.memory)
    guest = slots.config.guest
    return await build_template(
        BuildRequest.for_node(config, "base", ("base",)),
        images,
        driver,
        slots,
        templates,
        GuestNet(address=str(guest.ip), gateway=str(guest.gateway)),
    )


class Guest:
    """envd of one running sandbox, reached the way the proxy reaches it."""

    def __init__(self, orchestrator: Orchestrator, sandbox_id: str) -> None:
        endpoint = orchestrator.guest_endpoint(sandbox_id)
        self.url = f"http://{endpoint.host}:{ENVD_PORT}"
        self.headers = {"X-Access-Token": endpoint.record.envd_access_token or ""}

    async def write(self, path: str, data: bytes) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(
                f"{self.url}/files",
                params={"path": path, "username": "user"},
                headers={**self.headers, "Content-Type": "application/octet-stream"},
                content=data,
            )
        assert response.status_code == 200, response.text

    async def read(self, path: str) -> bytes:
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.get(
                f"{self.url}/files", params={"path": path, "username": "user"}, headers=self.headers
            )
        assert response.status_code == 200, response.text
        return response.content


def doubles_in(base: Path) -> list[int]:
    """Live processes of the double (peers and their guests) working under `base`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            cwd = (entry / "cwd").readlink()
        except OSError:
            continue
        ours = b"tests.runtime.firecracker.fc_" in cmdline and cwd.is_relative_to(base)
        if ours and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def request(template: str = "base") -> CreateRequest:
    return CreateRequest(template=template, timeout=600, metadata={}, env_vars={})


async def test_the_sandbox_lifecycle_through_the_orchestrator(
    world: tuple[Config, FirecrackerDriver, SlotPool, GuestImages],
) -> None:
    config, driver, slots, images = world
    template = await build_base(config, driver, slots, images)
    saved = template.snapshot()
    assert saved.driver == "firecracker" and saved.spec.kernel == images.vmlinux
    assert not any(is_qcow2(p) for p in saved.disks.values())

    node = await start_node(config, driver, slots)
    try:
        record, _ = await node.orchestrator.create(request())
        first = record.id
        await Guest(node.orchestrator, first).write(NOTE, b"written before every save")

        # Pause with memory, resume: a restore of the pause checkpoint.
        await node.orchestrator.pause(first)
        await node.orchestrator.resume(first, 600)
        assert await Guest(node.orchestrator, first).read(NOTE) == b"written before every save"

        # Pause without memory, resume: the checkpoint's disks booted (`boot_saved`).
        await node.orchestrator.pause(first, mode=SaveMode.FILESYSTEM)
        await node.orchestrator.resume(first, 600)
        assert await Guest(node.orchestrator, first).read(NOTE) == b"written before every save"

        # A snapshot of the running sandbox, exported, and a sandbox created from it.
        snapshot = await node.orchestrator.snapshot(first, name="noted")
        exported = snapshot.snapshot()
        assert all(p.parent == Path(snapshot.snapshot_dir) for p in exported.disks.values())
        from_snapshot, _ = await node.orchestrator.create(request("noted"))
        assert await Guest(node.orchestrator, from_snapshot.id).read(NOTE) == (
            b"written before every save"
        )

        # A fork of the running sandbox: two children with their own copies of its disk.
        children = await node.orchestrator.fork(first, 2, 600)
        for child in children:
            assert not isinstance(child, BaseException), child
            guest = Guest(node.orchestrator, child.id)
            assert await guest.read(NOTE) == b"written before every save"
            await guest.write(NOTE, child.id.encode())
        assert await Guest(node.orchestrator, first).read(NOTE) == b"written before every save"

        # A filesystem-only snapshot boots its disks for every sandbox created from it.
        fs_only = await node.orchestrator.snapshot(first, name="fs-only", mode=SaveMode.FILESYSTEM)
        cold, _ = await node.orchestrator.create(request(fs_only.template_id))
        assert await Guest(node.orchestrator, cold.id).read(NOTE) == b"written before every save"
    finally:
        await node.close()  # pauses every running sandbox (pause_on_shutdown)

    # A restart: the sandboxes paused at shutdown resume in a new orchestrator.
    node = await start_node(config, driver, slots)
    try:
        assert node.orchestrator.is_paused(first)
        await node.orchestrator.resume(first, 600)
        assert await Guest(node.orchestrator, first).read(NOTE) == b"written before every save"
        for record in node.orchestrator.list():
            await node.orchestrator.kill(record.id)
        assert node.orchestrator.list() == []
    finally:
        await node.close()
    leftovers = doubles_in(config.home.parent)  # the home, and the jails beside it
    assert leftovers == [], "a Firecracker double or its guest outlived the test"
    assert mounts_under(config.home.parent.resolve()) == [], "a jail's bind mount outlived its VM"


async def test_a_qcow2_never_reaches_firecracker(
    world: tuple[Config, FirecrackerDriver, SlotPool, GuestImages],
) -> None:
    """A template whose sealed disk is a qcow2 (what the QEMU driver makes) cannot start a
    Firecracker sandbox; the create fails cleanly and the template stays."""
    config, driver, slots, images = world
    template = await build_base(config, driver, slots, images)
    upper = template.snapshot().disks["upper"]
    upper.chmod(0o644)
    await layers.run_tool("qemu-img", "convert", "-O", "qcow2", upper, upper.with_suffix(".q"))
    upper.with_suffix(".q").replace(upper)
    node = await start_node(config, driver, slots)
    try:
        with pytest.raises(CreateFailed, match="qcow2"):
            await node.orchestrator.create(request())
        assert node.orchestrator.list() == []
        assert upper.is_file()
    finally:
        await node.close()


async def test_volume_mounts_are_refused_by_name(
    world: tuple[Config, FirecrackerDriver, SlotPool, GuestImages],
) -> None:
    """Firecracker has no shared-filesystem device: a create with `volumeMounts` answers 400
    naming the field and the reason through the node's API, before any VM starts."""
    config, driver, slots, _ = world
    node = await start_node(config, driver, slots)
    keys = KeyStore(config.home / "api-keys.json")
    keys.add(API_KEY, "test")
    transport = httpx.ASGITransport(app=create_api(node.orchestrator, config, keys))
    try:
        async with httpx.AsyncClient(
            transport=transport, base_url="http://node", headers={"X-API-KEY": API_KEY}
        ) as api:
            assert (await api.post("/volumes", json={"name": "v"})).status_code == 201
            body = {"templateID": "base", "volumeMounts": [{"name": "v", "path": "/mnt/v"}]}
            refused = await api.post("/v2/sandboxes", json=body)
            assert refused.status_code == 400, refused.text
            message = refused.json()["message"]
            assert message.startswith("volumeMounts: ") and NO_SHARES in message
        assert node.orchestrator.list() == [] and doubles_in(config.home.parent) == []
    finally:
        await node.close()


async def test_a_template_build_with_steps(
    world: tuple[Config, FirecrackerDriver, SlotPool, GuestImages],
) -> None:
    """A build from the base template at another size (its disks booted afresh), a RUN step
    whose file must reach the saved build layer and the finished template, and an ENV step."""
    config, driver, slots, images = world
    await build_base(config, driver, slots, images)
    node = await start_node(config, driver, slots)
    try:
        builder = Builder(node.orchestrator, TagStore(config.paths.template_tags), config.paths, 60)
        steps = (
            Step(StepType.RUN, ("echo built-in > /home/user/built.txt",)),
            Step(StepType.ENV, ("GREETING", "hi")),
        )
        build = builder.request("app", [], cpu_count=2)
        builder.start(build, BuildSpec(from_template="base", from_image=None, steps=steps))
        for _ in range(600):
            if build.status in (BuildStatus.READY, BuildStatus.ERROR):
                break
            await asyncio.sleep(0.2)
        assert build.status is BuildStatus.READY, build.reason
        template = node.templates.get("app")
        assert template.env_vars == {"GREETING": "hi"}
        assert not any(is_qcow2(p) for p in template.snapshot().disks.values())
        record, _ = await node.orchestrator.create(request("app"))
        assert await Guest(node.orchestrator, record.id).read("/home/user/built.txt") == (
            b"built-in\n"
        )
        await node.orchestrator.kill(record.id)
    finally:
        await node.close()
