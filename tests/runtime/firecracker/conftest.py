"""Fixtures for the Firecracker driver tests: the swagger validators, a Firecracker API peer
serving on a unix socket in this event loop, the peer as a stand-in `firecracker` binary, a driver
using it with real cgroups, a real network namespace, and a VM spec with small image files."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from aenv.mounts import unmount_under
from aenv.runtime import driver as d
from aenv.runtime.cgroups import CgroupError, CgroupManager, detect
from aenv.runtime.firecracker import FirecrackerConfig, FirecrackerDriver
from aenv.runtime.firecracker import models as m
from tests.runtime.firecracker import fc_peer, fc_swagger
from tests.runtime.firecracker.fc_support import GUEST_MAC, MEM_MIB
from tests.support.wait import eventually

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def swagger() -> fc_swagger.Swagger:
    # The swagger ships in the repository (specs/): a missing file is an error, not a skip.
    return fc_swagger.load()


@pytest.fixture(autouse=True)
def no_mounts_left(tmp_path: Path) -> Iterator[None]:
    """Undo the bind mounts a failed test left in its jails, so its temp dir can go."""
    yield
    unmount_under(tmp_path.resolve())


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A directory on /dev/shm (the node's memory root), removed afterwards."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("needs /dev/shm")
    directory = shm / f"aenv-fc-test-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
async def peer(tmp_path: Path, swagger: fc_swagger.Swagger) -> AsyncIterator[fc_peer.PeerState]:
    """A Firecracker peer on `tmp_path/api.sock`; the fixture value is its recorded state."""
    state = fc_peer.PeerState(root=tmp_path)
    socket_path = tmp_path / "api.sock"
    server = fc_peer.make_server(state, socket_path)
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started or task.done(), "the peer started or failed")
    assert server.started, "peer did not start"
    yield state
    server.should_exit = True
    await task


@pytest.fixture(scope="module")
def fake_firecracker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    binary = tmp_path_factory.mktemp("bin") / "firecracker"
    binary.write_text(
        f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m {fc_peer.__name__} "$@"\n'
    )
    binary.chmod(0o755)
    return binary


@pytest.fixture(scope="module")
def cgroups() -> Iterator[CgroupManager]:
    try:
        manager = detect(f"aenv-fc-test-{os.getpid()}")
    except CgroupError as exc:
        pytest.skip(f"no usable cgroup hierarchy: {exc}")
    yield manager
    manager.remove_parent()


@pytest.fixture
def driver(fake_firecracker: Path, cgroups: CgroupManager) -> FirecrackerDriver:
    rate = m.RateLimiter(ops=m.TokenBucket(size=1000, refill_time=1000))
    config = FirecrackerConfig(
        binary=fake_firecracker,
        ready_timeout_s=30,
        disk_rate_limiter=rate,
        net_tx_rate_limiter=rate,
        mmds_version="V2",
        vsock_cid=3,
    )
    return FirecrackerDriver(config, cgroups)


@pytest.fixture
async def netns() -> AsyncIterator[str]:
    name = f"aenvfc{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    yield name
    subprocess.run(["ip", "netns", "delete", name], check=True)


@pytest.fixture
def spec(tmp_path: Path, netns: str) -> d.VMSpec:
    images = tmp_path / "images"
    images.mkdir()
    (images / "vmlinux").write_bytes(b"\x7fELF kernel")
    (images / "initrd").write_bytes(b"initrd")
    (images / "base.ext4").write_bytes(b"base image")
    upper = images / "upper.ext4"
    with upper.open("wb") as f:
        f.truncate(16 << 20)
        f.seek(1 << 20)
        f.write(b"written by the source guest")
    workdir = tmp_path / "vm0"
    workdir.mkdir()
    return d.VMSpec(
        vcpus=2,
        memory_mib=MEM_MIB,
        kernel=images / "vmlinux",
        initrd=images / "initrd",
        cmdline="console=ttyS0 quiet",
        workdir=workdir,
        disks=(
            d.Disk("base", images / "base.ext4", read_only=True),
            d.Disk("upper", upper),
        ),
        net=d.NetAttachment(netns=netns, tap="tap0", mac=GUEST_MAC),
    )
