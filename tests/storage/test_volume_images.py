"""Volume images on the host (root: they are loop-mounted): a volume's directory is the mount of
an ext4 image of its size, `nosuid,nodev,noexec`; writes past the size fail with ENOSPC, also
through the volume content API's files; it is detached and attached again as a node stops and
starts, and nothing of it (mount, loop device, image) is left once destroyed. What guests see
of it is tested in real guests in tests/e2e/volumes."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.orchestrator.volume_entries import Owner
from aenv.orchestrator.volume_files import Problem, VolumeFiles, VolumePathError
from aenv.storage.volume_images import ImageBacking, VolumeBusy
from tests.support.volume_mounts import loop_devices_of, release_volume_images

SIZE_MB = 32


@pytest.fixture
def backing(tmp_path: Path) -> Iterator[ImageBacking]:
    if os.geteuid() != 0:
        pytest.skip("volume images are loop-mounted: root only")
    try:
        yield ImageBacking(tmp_path / "volumes", tmp_path / "images")
    finally:
        release_volume_images(tmp_path)


def _options(directory: Path) -> set[str]:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        if fields[4] == str(directory):
            return set(fields[5].split(","))
    return set()


def test_a_volume_is_an_image_of_its_size(backing: ImageBacking) -> None:
    backing.make("vol_a", SIZE_MB)
    root = backing.directories / "vol_a"
    assert os.path.ismount(root) and list(root.iterdir()) == []  # no lost+found
    assert {"nosuid", "nodev", "noexec", "rw"} <= _options(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o777
    fs = os.statvfs(root)
    # Less the journal and inode tables (a quarter of so small a filesystem).
    assert SIZE_MB * 3 << 18 <= fs.f_blocks * fs.f_frsize <= SIZE_MB << 20
    # No 5% for root (VMMs write as other uids); ext4 keeps back only its 2% for delayed writes.
    assert fs.f_bavail >= fs.f_bfree * 0.97
    image = backing.image("vol_a")
    assert image.stat().st_size == SIZE_MB << 20
    assert image.stat().st_blocks * 512 < SIZE_MB << 19  # sparse
    assert 0 < backing.unwritten_mb("vol_a", SIZE_MB) < SIZE_MB

    with pytest.raises(OSError) as full, open(root / "big", "wb") as f:
        for _ in range(SIZE_MB + 1):
            f.write(b"\xff" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
    assert full.value.errno == errno.ENOSPC
    assert backing.unwritten_mb("vol_a", SIZE_MB) < SIZE_MB // 4  # it filled the image
    (root / "big").unlink()


def test_the_content_api_meets_the_bound(backing: ImageBacking) -> None:
    backing.make("vol_b", SIZE_MB)
    files = VolumeFiles(backing.directories)
    kept = files.begin_write("vol_b", "/kept", Owner(), parents=False)
    kept.write(b"old")
    kept.commit()
    upload = files.begin_write("vol_b", "/kept", Owner(), parents=False)
    try:
        with pytest.raises(VolumePathError) as full:
            for _ in range(SIZE_MB + 1):
                upload.write(b"\xff" * (1 << 20))
                os.fsync(upload.fd)
        assert full.value.problem is Problem.NO_SPACE
    finally:
        upload.abort()
    assert (backing.directories / "vol_b" / "kept").read_bytes() == b"old"


def test_detach_attach_and_destroy_leave_nothing(backing: ImageBacking) -> None:
    backing.make("vol_c", SIZE_MB)
    root, image = backing.directories / "vol_c", backing.image("vol_c")
    (root / "note").write_text("kept")
    with open(root / "note") as held:
        with pytest.raises(VolumeBusy, match="in use"):
            backing.detach("vol_c")
        assert os.path.ismount(root) and held.read() == "kept"
    backing.detach("vol_c")
    assert not os.path.ismount(root) and list(root.iterdir()) == []
    assert loop_devices_of(image) == []  # the unmount freed it
    backing.attach("vol_c")
    backing.attach("vol_c")  # mounted already (a crashed node's mount): kept, not mounted twice
    assert (root / "note").read_text() == "kept"
    assert len(loop_devices_of(image)) == 1
    backing.destroy("vol_c")
    assert not root.exists() and not image.exists() and loop_devices_of(image) == []


def test_a_failed_make_leaves_nothing(backing: ImageBacking) -> None:
    with pytest.raises(OSError, match="File too large"):
        backing.make("vol_d", 1 << 40)  # past ext4's largest file on the host
    assert list(backing.images.iterdir()) == [] and not (backing.directories / "vol_d").exists()
