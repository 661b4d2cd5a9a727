"""Volume images: the files of a sized volume live in a sparse ext4 image file of its size
(`Paths.volume_images/<id>.ext4`), loop-mounted at the volume's directory while the node runs.

Guests reach a volume through their VMM's 9p server, which works on that directory: a write past
the size fails with ENOSPC in the guest, and the guest's `df` shows the image's filesystem (9p
passes statfs through), not the host's. The host mounts it `nosuid,nodev,noexec`: what a guest
plants there (9p's `mapped-xattr` stores its special files as plain files anyway) never acts on
the host. The image is sparse: it takes host disk as it is written, up to its size
(`VolumeStore` counts the rest against the node's disk reserve).

Mounts use util-linux's `mount -o loop`, whose loop device goes with the unmount (autoclear), and
which reuses the loop device of an image already attached rather than mount one filesystem
twice. A mount a crashed node left is found mounted and kept. Calls block: run them in a thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

MOUNT_OPTIONS = "loop,nosuid,nodev,noexec"
# A volume's root: VMMs of other uids, and guest users of any uid, create and remove files in
# it (the jail grants it as `Access.SHARED_DIR`); its parent (0700) keeps host users out.
SHARED_DIR_MODE = 0o777


class VolumeImageError(RuntimeError):
    """An image could not be made, mounted or unmounted; the message says which and why."""


class VolumeBusy(VolumeImageError):
    """The volume's filesystem is in use (an open file) and could not be unmounted."""


class ImageBacking:
    """The images of the volumes whose directories are under `directories`."""

    def __init__(self, directories: Path, images: Path) -> None:
        self.directories = directories
        self.images = images

    def image(self, volume_id: str) -> Path:
        return self.images / f"{volume_id}.ext4"

    def make(self, volume_id: str, size_mb: int) -> None:
        """A new image of `size_mb` MiB, mounted at the volume's directory. On failure nothing
        of it is left."""
        image = self.image(volume_id)
        self.images.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            with open(image, "xb") as file:
                os.fchmod(file.fileno(), 0o600)
                file.truncate(size_mb << 20)
            # No blocks reserved for root: guests write through VMMs of other uids. No discard
            # of a fresh sparse file.
            _run("mkfs.ext4", "-q", "-F", "-m", "0", "-E", "nodiscard", "-L", "aenv-volume", image)
            self.attach(volume_id)
            root = self.directories / volume_id
            # Guests see an empty volume; e2fsck makes lost+found again when it needs one.
            (root / "lost+found").rmdir()
            # Guest users of any uid write in it (a VMM's uid); the parent (0700) keeps host
            # users out.
            root.chmod(SHARED_DIR_MODE)
        except (OSError, VolumeImageError):
            with contextlib.suppress(VolumeImageError):
                self.destroy(volume_id)
            raise

    def attach(self, volume_id: str) -> None:
        """Mount the volume's image at its directory, unless it is mounted there already."""
        directory = self.directories / volume_id
        directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.mkdir(exist_ok=True)
        if not os.path.ismount(directory):
            _run("mount", "-t", "ext4", "-o", MOUNT_OPTIONS, self.image(volume_id), directory)

    def detach(self, volume_id: str) -> None:
        """Unmount the volume's image, if mounted; raises `VolumeBusy` when it is in use."""
        directory = self.directories / volume_id
        if os.path.ismount(directory):
            try:
                _run("umount", directory)
            except VolumeImageError as e:
                raise VolumeBusy(f"volume {volume_id} is in use: {e}") from e

    def destroy(self, volume_id: str) -> None:
        """Unmount the volume, remove its image and its (empty) directory."""
        self.detach(volume_id)
        self.image(volume_id).unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            (self.directories / volume_id).rmdir()

    def unwritten_mb(self, volume_id: str, size_mb: int) -> int:
        """What the image can still take of the host's disk before it is full."""
        try:
            used = os.stat(self.image(volume_id)).st_blocks * 512
        except FileNotFoundError:
            return size_mb
        return max(size_mb - (used >> 20), 0)


def _run(*argv: str | Path) -> None:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        what = " ".join(str(a) for a in argv)
        raise VolumeImageError(f"{what}: {result.stderr.strip() or result.returncode}")
