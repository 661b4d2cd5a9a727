"""A volume backing that needs no root: each sized volume is a plain directory, "mounted" while
in `attached`. It keeps `orchestrator.volumes.VolumeBacking`'s contract (a volume is made once,
attached only once made, not destroyed while `busy`) but bounds nothing: sizes, ENOSPC and
mount options are `storage.volume_images`'s, tested with real images in
tests/storage/test_volume_images.py and in real guests in tests/e2e/volumes."""

from __future__ import annotations

import shutil
from pathlib import Path

from aenv.storage.volume_images import SHARED_DIR_MODE, VolumeBusy, VolumeImageError


class DirectoryBacking:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.sizes: dict[str, int] = {}
        self.attached: set[str] = set()
        self.busy: set[str] = set()  # tests add a volume to play one whose file is open
        self.broken: set[str] = set()  # tests add a volume to play an image that cannot mount
        self.make_fails = False  # tests set it to play a mkfs or mount that fails

    def make(self, volume_id: str, size_mb: int) -> None:
        if self.make_fails:
            raise VolumeImageError(f"mkfs.ext4 of volume {volume_id} failed")
        directory = self.root / volume_id
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.mkdir()
        directory.chmod(SHARED_DIR_MODE)
        self.sizes[volume_id] = size_mb
        self.attached.add(volume_id)

    def attach(self, volume_id: str) -> None:
        if volume_id not in self.sizes or volume_id in self.broken:
            raise VolumeImageError(f"volume {volume_id} has no image to mount")
        self.attached.add(volume_id)

    def detach(self, volume_id: str) -> None:
        if volume_id in self.busy:
            raise VolumeBusy(f"volume {volume_id} is in use")
        self.attached.discard(volume_id)

    def destroy(self, volume_id: str) -> None:
        self.detach(volume_id)
        shutil.rmtree(self.root / volume_id, ignore_errors=True)
        self.sizes.pop(volume_id, None)

    def unwritten_mb(self, volume_id: str, size_mb: int) -> int:
        return size_mb
