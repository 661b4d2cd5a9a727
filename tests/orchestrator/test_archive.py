"""The node's archive of saved sandbox states, on the configured repository: a POSIX directory
or a real S3 server (moto) on loopback. A layered checkpoint is stored self-contained and comes
back bit for bit into the directory it was exported from; damage is refused."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from aenv.config import Config, ConfigError
from aenv.orchestrator.archive import Archive
from aenv.orchestrator.repository import open_archive
from aenv.runtime.driver import Disk, Snapshot, VMSpec
from aenv.runtime.qemu import QemuDriver
from aenv.storage.repository import CorruptChunk
from tests.support.ports import free_port


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(params=["posix", "s3"])
def archive(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Archive]:
    if request.param == "posix":
        config = Config(home=tmp_path / "home")
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        for name, value in {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(name, value)
        bucket = f"aenv-{secrets.token_hex(4)}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        config = Config(
            home=tmp_path / "home", repository=f"s3://{bucket}/node1", repository_endpoint=endpoint
        )
    opened = open_archive(config)
    assert opened is not None
    yield opened
    opened.close()


def _qemu_img(*args: str | Path) -> None:
    subprocess.run(["qemu-img", *map(str, args)], check=True, capture_output=True)


def _qemu_io(image: Path, command: str) -> None:
    subprocess.run(["qemu-io", "-c", command, str(image)], check=True, capture_output=True)


def _layered_checkpoint(directory: Path, kernel: Path = Path("/boot/vmlinuz")) -> Snapshot:
    """A checkpoint whose disk is a two-layer qcow2 chain, as a pause leaves it."""
    directory.mkdir(parents=True)
    base = directory / "base.qcow2"
    _qemu_img("create", "-q", "-f", "qcow2", base, "64M")
    _qemu_io(base, "write -P 0x5a 0 1M")
    top = directory / "upper.qcow2"
    _qemu_img("create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", top)
    _qemu_io(top, "write -P 0xa5 4M 1M")
    state = directory / "state"
    state.write_bytes(os.urandom(3 << 20))
    spec = VMSpec(
        vcpus=1,
        memory_mib=64,
        kernel=kernel,
        cmdline="console=ttyS0",
        workdir=directory,
        disks=(Disk("upper", top),),
    )
    snapshot = Snapshot("qemu", "test", spec, state, None, {"upper": top})
    snapshot.save_manifest()
    return snapshot


def test_checkpoint_round_trip_is_self_contained(archive: Archive, tmp_path: Path) -> None:
    checkpoint = _layered_checkpoint(tmp_path / "pause-1")
    staging = tmp_path / "archive-1"
    driver = QemuDriver()
    manifest_id = asyncio.run(
        archive.push_checkpoint(checkpoint, staging, driver, name="t", metadata={"sandbox": "x"})
    )
    assert not staging.exists()  # uploaded, then removed

    pulled = asyncio.run(archive.pull(manifest_id, staging, driver))
    assert pulled == Snapshot.load_manifest(staging)
    assert pulled.state_file == staging / "state"
    assert pulled.state_file.read_bytes() == checkpoint.state_file.read_bytes()
    info = json.loads(
        subprocess.run(
            ["qemu-img", "info", "--output=json", str(pulled.disks["upper"])],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert "backing-filename" not in info  # flattened: needs nothing of the sandbox
    compare = subprocess.run(
        ["qemu-img", "compare", str(checkpoint.disks["upper"]), str(pulled.disks["upper"])],
        capture_output=True,
    )
    assert compare.returncode == 0, compare.stdout


def test_another_node_pulls_into_its_own_directories(archive: Archive, tmp_path: Path) -> None:
    """A node sharing the repository (a cluster) pulls a copy another node made: the paths in
    its snapshot.json name the puller's directories, and the read-only files the checkpoint
    names travel in the copy (the maker's exact bytes), not looked up among the puller's."""
    maker = Archive(archive.repository, archive.home, portable=True)
    images = maker.home / "cache" / "images"
    images.mkdir(parents=True)
    (images / "vmlinux").write_bytes(b"kernel")
    (images / "envd.ext4").write_bytes(os.urandom(1 << 20))
    sandbox_dir = maker.home / "sandboxes" / "sbx"
    layered = _layered_checkpoint(sandbox_dir / "pause-1", images / "vmlinux")
    spec = dataclasses.replace(
        layered.spec, disks=(*layered.spec.disks, Disk("envd", images / "envd.ext4", True))
    )
    checkpoint = dataclasses.replace(layered, spec=spec)
    driver = QemuDriver()
    manifest_id = asyncio.run(
        maker.push_checkpoint(checkpoint, sandbox_dir / "archive-1", driver, name="t", metadata={})
    )
    other = Archive(archive.repository, tmp_path / "home-b")
    dest = other.home / "sandboxes" / "sbx" / "archive-1"
    pulled = asyncio.run(other.pull(manifest_id, dest, driver))
    assert pulled.state_file == dest / "state"
    assert pulled.disks == {"upper": dest / "upper.qcow2"}
    assert pulled.spec.kernel == dest / "images" / "vmlinux"
    envd = next(d for d in pulled.spec.disks if d.read_only)
    assert envd.path == dest / "images" / "envd.ext4"
    assert envd.path.read_bytes() == (images / "envd.ext4").read_bytes()
    assert pulled.state_file.read_bytes() == checkpoint.state_file.read_bytes()
    assert f"{maker.home}/" not in (dest / "snapshot.json").read_text()


def test_damaged_chunk_is_refused(archive: Archive, tmp_path: Path) -> None:
    checkpoint = _layered_checkpoint(tmp_path / "pause-1")
    manifest_id = asyncio.run(
        archive.push_checkpoint(
            checkpoint, tmp_path / "archive-1", QemuDriver(), name="t", metadata={}
        )
    )
    repository = archive.repository
    manifest = asyncio.run(repository.manifest(manifest_id))
    state = next(f for f in manifest.files if f.path == "state")
    digest = next(d for d in state.chunks if d)
    key = f"chunks/{digest[:2]}/{digest}"
    blob = bytearray(repository.store.get(key))
    blob[-1] ^= 0xFF
    repository.store.put(key, bytes(blob))
    if repository.cache is not None:
        repository.cache.discard(digest)
    with pytest.raises(CorruptChunk):
        asyncio.run(archive.pull(manifest_id, tmp_path / "restored", QemuDriver()))
    assert not (tmp_path / "restored").exists()


def test_repository_configuration(tmp_path: Path) -> None:
    assert open_archive(Config(home=tmp_path, repository="off")) is None
    with pytest.raises(ConfigError):
        open_archive(Config(home=tmp_path, repository="ftp://somewhere"))
    with pytest.raises(ConfigError):
        open_archive(Config(home=tmp_path, repository="s3://"))
