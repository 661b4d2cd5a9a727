"""Content-addressed guest images and template staleness, with small stand-in artifacts (no image
builds, no VMs): names follow content, published files are never replaced, and a template
remembers which images it was built from."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import uuid
from pathlib import Path

import pytest

from aenv.config import DEFAULT_MIRROR as MIRROR
from aenv.config import Config
from aenv.guest.cmdline import GuestNet
from aenv.guest.kernel import Kernel
from aenv.guest.rootfs import BaseRootfs
from aenv.orchestrator import images
from aenv.orchestrator.images import GuestImages, prepare_images, publish, tree_digest
from aenv.orchestrator.templates import (
    TEMPLATE_FILE,
    BuildRequest,
    Template,
    TemplateStore,
    build_template,
    is_stale,
)
from aenv.runtime.driver import Disk, Snapshot, VMSpec
from aenv.runtime.firecracker import FirecrackerDriver
from aenv.runtime.qemu import QemuDriver
from tests.doubles.driver import DoubleDriver, write_disk
from tests.doubles.node import TEMPLATE_FILES
from tests.doubles.slots import DoubleSlots


def rebuild(path: Path, content: bytes) -> None:
    """Write `path` the way the build cache does: a new file renamed over the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(content)
    tmp.replace(path)


def test_publish_names_follow_content(tmp_path: Path) -> None:
    source, store = tmp_path / "rootfs.ext4", tmp_path / "images"
    store.mkdir()
    rebuild(source, b"v1")
    first = publish(source, store, "rootfs", ".ext4")
    assert first.name.startswith("rootfs-") and first.suffix == ".ext4"
    assert publish(source, store, "rootfs", ".ext4") == first

    rebuild(source, b"v1")  # rebuilt with the same content: same name
    assert publish(source, store, "rootfs", ".ext4") == first

    rebuild(source, b"v2")
    second = publish(source, store, "rootfs", ".ext4")
    assert second != first
    assert first.read_bytes() == b"v1" and second.read_bytes() == b"v2"
    assert sorted(p.name for p in store.iterdir()) == sorted([first.name, second.name])


def test_publish_never_replaces_a_published_file(tmp_path: Path) -> None:
    store = tmp_path / "images"
    store.mkdir()
    rebuild(tmp_path / "a" / "initrd", b"same")
    rebuild(tmp_path / "b" / "initrd", b"same")
    first = publish(tmp_path / "a" / "initrd", store, "initrd", "")
    inode = first.stat().st_ino
    assert publish(tmp_path / "b" / "initrd", store, "initrd", "") == first
    assert first.stat().st_ino == inode


def test_publish_copies_across_filesystems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, store = tmp_path / "vmlinux", tmp_path / "images"
    store.mkdir()
    rebuild(source, b"kernel")
    real_link = os.link

    def link(src: os.PathLike[str], dst: os.PathLike[str]) -> None:
        if Path(src) == source:
            raise OSError(18, "Invalid cross-device link")
        real_link(src, dst)

    monkeypatch.setattr(os, "link", link)
    published = publish(source, store, "vmlinux", "")
    assert published.read_bytes() == b"kernel"
    assert not published.samefile(source)
    assert publish(source, store, "vmlinux", "") == published  # found by content this time
    assert [p.name for p in store.iterdir()] == [published.name]  # no scratch file left


def test_tree_digest_follows_content_not_timestamps(tmp_path: Path) -> None:
    tree = tmp_path / "envd"
    rebuild(tree / "aenv-envd", b"#!/bin/sh\n")
    rebuild(tree / "_internal" / "lib.so", b"lib")
    before = tree_digest(tree)
    os.utime(tree / "_internal" / "lib.so", (0, 0))
    rebuild(tree / "aenv-envd", b"#!/bin/sh\n")
    assert tree_digest(tree) == before
    (tree / "aenv-envd").chmod(0o755)
    assert tree_digest(tree) != before
    changed = tree_digest(tree)
    rebuild(tree / "_internal" / "lib.so", b"lib2")
    assert tree_digest(tree) != changed


class FakeBuilds:
    """Stand-ins for the guest builds `prepare_images` calls; `rebuild_all` changes every
    artifact in place, as an upgrade that changes the kernel, rootfs recipe and envd would."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.guest_cache = root / "guest-cache"
        self.drives_built = 0
        self.write(b"v1")
        monkeypatch.setattr(images, "fetch_kernel", self.fetch_kernel)
        monkeypatch.setattr(images, "build_initramfs", self.build_initramfs)
        monkeypatch.setattr(images, "build_base_rootfs", self.build_base_rootfs)
        monkeypatch.setattr(images, "build_bundle", self.build_bundle)
        monkeypatch.setattr(images, "build_envd_drive", self.build_envd_drive)

    def write(self, version: bytes) -> None:
        for name in ("vmlinuz", "vmlinux", "initrd.cpio.gz", "rootfs.ext4"):
            rebuild(self.root / name, name.encode() + version)
        rebuild(self.root / "envd" / "aenv-envd", b"envd " + version)

    async def fetch_kernel(self, cache: Path) -> Kernel:
        assert cache == self.guest_cache
        r = self.root
        return Kernel("6.1", r / "vmlinuz", r / "vmlinux", r / "modules", r / "config")

    async def build_initramfs(self, kernel: Kernel, cache: Path) -> Path:
        return self.root / "initrd.cpio.gz"

    async def build_base_rootfs(self, cache: Path, mirror: str) -> BaseRootfs:
        return BaseRootfs(tree=self.root / "tree", image=self.root / "rootfs.ext4")

    def build_bundle(self, out: Path) -> Path:
        assert out == self.guest_cache / "envd"  # shared by every node of the guest cache
        return self.root / "envd" / "aenv-envd"

    async def build_envd_drive(self, bundle: Path, image: Path) -> Path:
        # Like mkfs: the same tree gives different bytes each time (UUID, timestamps).
        self.drives_built += 1
        image.write_bytes((bundle / "aenv-envd").read_bytes() + secrets.token_bytes(8))
        return image


def saved_snapshot(directory: Path, guest: GuestImages) -> Snapshot:
    """A snapshot manifest naming the images the way a template or paused sandbox does."""
    directory.mkdir(parents=True)
    spec = VMSpec(
        vcpus=1,
        memory_mib=512,
        kernel=guest.kernel,
        initrd=guest.initrd,
        cmdline="console=ttyS0",
        workdir=directory,
        disks=(
            Disk("root", guest.rootfs, read_only=True),
            Disk("upper", directory / "upper.qcow2"),
            Disk("envd", guest.envd_drive, read_only=True),
        ),
    )
    snap = Snapshot("qemu", "test", spec, directory / "state", None, {})
    snap.state_file.write_bytes(b"device state")
    snap.save_manifest()
    return snap


def referenced(snap: Snapshot) -> list[Path]:
    spec = snap.spec
    assert spec.initrd is not None
    return [spec.kernel, spec.initrd, *(d.path for d in spec.disks if d.read_only)]


async def test_rebuilt_images_get_new_files_and_old_ones_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds = FakeBuilds(tmp_path / "guest", monkeypatch)
    cache = tmp_path / "cache"
    old = await prepare_images(cache, builds.guest_cache, MIRROR)
    # Nothing changed: the same files, the drive built once.
    assert await prepare_images(cache, builds.guest_cache, MIRROR) == old
    assert builds.drives_built == 1
    snap = saved_snapshot(tmp_path / "templates" / "snap" / "build", old)
    contents = {p: p.read_bytes() for p in referenced(snap)}

    builds.write(b"v2")
    new = await prepare_images(cache, builds.guest_cache, MIRROR)
    assert builds.drives_built == 2
    for field in ("kernel", "vmlinux", "initrd", "rootfs", "envd_drive"):
        before, after = getattr(old, field), getattr(new, field)
        assert before != after and before.parent == after.parent == cache / "images"
    assert new.identity != old.identity
    assert new.envd_drive.read_bytes().startswith(b"envd v2")
    # The saved VM still finds exactly the bytes it was saved with.
    reloaded = Snapshot.load_manifest(tmp_path / "templates" / "snap" / "build")
    assert {p: p.read_bytes() for p in referenced(reloaded)} == contents


async def test_the_envd_bundle_is_built_in_the_shared_guest_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds = FakeBuilds(tmp_path / "guest", monkeypatch)
    cache = tmp_path / "cache"
    for stale in ("envd", "envd-build"):  # where an older version built it, per node
        (cache / stale / "sub").mkdir(parents=True)
    await prepare_images(cache, builds.guest_cache, MIRROR)  # FakeBuilds checks where
    assert sorted(p.name for p in cache.iterdir()) == ["images"]


def images_named(directory: Path, tag: str) -> GuestImages:
    return GuestImages(*(directory / f"{n}-{tag}" for n in ("k", "vmlinux", "i", "r", "e")))


def test_identity_follows_every_image_the_vm_uses(tmp_path: Path) -> None:
    guest = images_named(tmp_path, "1")
    assert guest.identity == images_named(tmp_path, "1").identity
    for field in ("kernel", "initrd", "rootfs", "envd_drive"):
        other = dataclasses.replace(guest, **{field: tmp_path / "other"})
        assert other.identity != guest.identity
    # Only the kernel the driver boots counts (`booted_by` picks it).
    assert dataclasses.replace(guest, vmlinux=tmp_path / "other").identity == guest.identity


def test_each_driver_boots_its_own_kernel_form(tmp_path: Path) -> None:
    guest = images_named(tmp_path, "1")
    assert guest.booted_by(QemuDriver()) == guest
    firecracker = guest.booted_by(FirecrackerDriver())
    assert firecracker.kernel == guest.vmlinux
    assert firecracker.identity != guest.identity  # a template of one is stale for the other


def make_template(store: TemplateStore, template_id: str, images: str | None) -> Template:
    snap_dir = store.directory / template_id / "snapshot"
    snap_dir.mkdir(parents=True)
    spec = VMSpec(vcpus=1, memory_mib=512, kernel=Path("k"), cmdline="", workdir=snap_dir)
    (snap_dir / "state").write_bytes(b"device state")
    Snapshot("qemu", "test", spec, snap_dir / "state", None, {}).save_manifest()
    template = Template(
        template_id=template_id,
        build_id="b1",
        aliases=(template_id,),
        cpu_count=1,
        memory_mb=512,
        disk_size_mb=1024,
        envd_version="0.1.0",
        envd_access_token="tok",
        created_at=0.0,
        snapshot_dir=str(snap_dir),
        images=images,
    )
    store.save(template)
    return template


@pytest.fixture
def store(tmp_path: Path) -> TemplateStore:
    store = TemplateStore(tmp_path / "templates", tmp_path / "memory")
    store.directory.mkdir()
    return store


def test_template_built_from_other_images_is_stale(tmp_path: Path, store: TemplateStore) -> None:
    current = images_named(tmp_path, "v2")
    fresh = make_template(store, "fresh", current.identity)
    outdated = make_template(store, "outdated", images_named(tmp_path, "v1").identity)
    store.load()
    assert not is_stale(store.get("fresh"), current) and not is_stale(fresh, current)
    assert is_stale(store.get("outdated"), current) and is_stale(outdated, current)


def test_template_json_without_images_loads_as_stale(tmp_path: Path, store: TemplateStore) -> None:
    make_template(store, "base", "whatever")
    meta = store.directory / "base" / TEMPLATE_FILE
    raw = json.loads(meta.read_text())
    del raw["images"]  # written by a version that did not record them
    meta.write_text(json.dumps(raw))
    store.load()
    loaded = store.get("base")
    assert loaded.images is None
    assert is_stale(loaded, images_named(tmp_path, "v1"))


def test_unfinished_saved_states_are_removed(tmp_path: Path, store: TemplateStore) -> None:
    make_template(store, "done", "whatever")
    half = store.directory / "half" / "build-1"
    half.mkdir(parents=True)
    (half / "state").write_bytes(b"cut short before template.json")
    (store.memory_dir / "half").mkdir(parents=True)
    assert store.remove_unfinished() == ["half"]
    assert sorted(p.name for p in store.directory.iterdir()) == ["done"]
    assert not (store.memory_dir / "half").exists()
    store.load()
    assert store.get("done").template_id == "done"


async def test_the_base_template_build_id_is_a_uuid(tmp_path: Path) -> None:
    """E2B's `buildID` is a UUID (the SDKs and the spec say so): the node's own base template's
    too, as `build_template` makes it."""
    slots = DoubleSlots()
    images = images_named(tmp_path / "images", "a")
    images.rootfs.parent.mkdir(parents=True)
    for path in (images.kernel, images.initrd, images.envd_drive):
        path.write_bytes(b"\0" * 512)
    write_disk(images.rootfs, TEMPLATE_FILES)
    store = TemplateStore(tmp_path / "templates", tmp_path / "shm")
    request = BuildRequest.for_node(Config(home=tmp_path), "base", ("base",))
    guest = GuestNet(address="10.11.0.2/24", gateway="10.11.0.1")
    template = await build_template(request, images, DoubleDriver(slots), slots, store, guest)
    assert str(uuid.UUID(template.build_id)) == template.build_id
    assert slots.in_use == {}
