"""Volumes: named directories of the node that sandboxes mount into their guests and share.

A volume is a catalog row (`VolumeRecord`) and a directory `Paths.volumes/<id>`. The row is
written before the directory exists and removed after it is gone, so a crash in between leaves
a volume that lists and can be deleted again, never a directory nobody knows. A volume mounted
by a sandbox that still exists (running or paused) cannot be deleted: its guest would lose its
files under it.

A volume has a size (`sizeMB` at its create, else `volume_size_mb`): its directory is the mount
point of a filesystem of that size while the node runs (`VolumeBacking`; on a real node
`storage.volume_images`), attached at the node's start and detached at its stop. The host's
free disk above `reserve_disk_mb` must hold the new volume and what existing ones have not
written yet, or the create is refused (`NoRoom`). Volumes made before sizes (`size_mb` None)
stay plain directories, bounded by the host's disk only: the node warns of each at its start.

How a mount reaches the guest is the driver's business (`runtime.driver.Share`); which paths
a guest may mount a volume at is decided here (`check_mount_path`).
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import posixpath
import re
import secrets
import shutil
import time
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Protocol

from aenv.ids import TEAM_ID, new_access_token
from aenv.orchestrator.catalog import Catalog, SandboxRecord, VolumeMount, VolumeRecord
from aenv.orchestrator.reserve import HostReserve
from aenv.runtime.driver import Share, share_tag
from aenv.storage.volume_images import VolumeBusy

log = logging.getLogger(__name__)

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_MOUNTS = 8
# The guest's system directories (components are glob patterns: `lib*` is every top-level
# library directory). A volume at one of them or at a parent hides it (`/opt` hides envd's
# `/opt/aenv`), and one inside it breaks it as surely (`/etc/ssl`, `/usr/lib`), except under
# the roomy ones, where a volume only adds a directory (`/var/lib/db`).
_SYSTEM = ("/bin", "/dev", "/etc", "/lib*", "/opt/aenv", "/proc", "/run", "/sbin", "/sys", "/usr")
_SYSTEM_ROOMY = ("/boot", "/root", "/var")


class VolumeNotFound(LookupError):
    def __init__(self, volume: str) -> None:
        super().__init__(f"volume '{volume}' not found")


class VolumeUnavailable(VolumeNotFound):
    """A sized volume whose filesystem could not be mounted at the node's start."""

    def __init__(self, volume: str) -> None:
        LookupError.__init__(self, f"volume '{volume}' is unavailable: its image is not mounted")


class VolumeInUse(RuntimeError):
    """The volume is mounted by sandboxes that still exist."""


class BadMount(ValueError):
    """A mount request the node refuses (a bad path, two mounts at one path)."""


class NoRoom(RuntimeError):
    """The host's disk above its reserve cannot hold the volume; nothing was made."""


class VolumeBacking(Protocol):
    """What holds a sized volume's files, mounted at `<root>/<id>` between `attach` and
    `detach`. Calls block."""

    def make(self, volume_id: str, size_mb: int) -> None:
        """A new, empty, attached volume of `size_mb`; on failure nothing of it is left."""

    def attach(self, volume_id: str) -> None:
        """Mounted at its directory (nothing done when it is already)."""

    def detach(self, volume_id: str) -> None:
        """Unmounted (nothing done when it is not); raises `VolumeBusy` when in use."""

    def destroy(self, volume_id: str) -> None:
        """Detached, its files and directory gone; raises `VolumeBusy` when in use."""

    def unwritten_mb(self, volume_id: str, size_mb: int) -> int:
        """What it can still take of the host's disk."""


def new_volume_id() -> str:
    return "vol_" + secrets.token_hex(10)


def check_name(name: str) -> None:
    if not NAME.fullmatch(name):
        raise BadMount(f"volume name '{name}' must be 1-64 of a-z, A-Z, 0-9, '_' and '-'")


def check_mount_path(path: str) -> str:
    """The normalised absolute guest path, or `BadMount` naming the problem."""
    if not path.startswith("/") or "\0" in path or len(path) > 1024:
        raise BadMount(f"volume mount path '{path}' must be an absolute path")
    if ".." in path.split("/"):
        raise BadMount(f"volume mount path '{path}' must not contain '..'")
    # POSIX lets a path start with exactly two slashes and normpath keeps them; Linux does not
    # tell them apart from one.
    normal = "/" + posixpath.normpath(path).lstrip("/")
    parts = PurePosixPath(normal).parts
    for system in (*_SYSTEM, *_SYSTEM_ROOMY):
        pattern = PurePosixPath(system).parts
        if all(map(fnmatch.fnmatchcase, parts, pattern)) and (
            len(parts) <= len(pattern) or system in _SYSTEM
        ):
            raise BadMount(f"volume mount path '{path}' would hide the guest's system files")
    return normal


class VolumeStore:
    def __init__(
        self,
        catalog: Catalog,
        root: Path,
        backing: VolumeBacking,
        reserve: HostReserve,
        default_size_mb: int,
        no_shares: str | None = None,
    ) -> None:
        """`no_shares`: why the node's VMs cannot mount volumes (its driver's), if they cannot."""
        self.catalog = catalog
        self.root = root
        self.backing = backing
        self.reserve = reserve
        self.default_size_mb = default_size_mb
        self.no_shares = no_shares
        # One create at a time: each one's room check counts the volumes made before it.
        self._creating = asyncio.Lock()
        # Sized volumes whose filesystem `attach_all` could not mount.
        self.unavailable: set[str] = set()

    def directory(self, volume_id: str) -> Path:
        return self.root / volume_id

    def list(self, team_id: str | None = None) -> list[VolumeRecord]:
        """Every volume; of `team_id` only, when given."""
        return self.catalog.volumes(team_id)

    def get(self, volume_id: str) -> VolumeRecord:
        found = self.catalog.volume(volume_id=volume_id)
        if found is None:
            raise VolumeNotFound(volume_id)
        return found

    def named(self, name: str, team_id: str = TEAM_ID) -> VolumeRecord:
        found = self.catalog.volume(name=name, team_id=team_id)
        if found is None:
            raise VolumeNotFound(name)
        return found

    async def create(
        self, name: str, size_mb: int | None = None, team_id: str = TEAM_ID
    ) -> VolumeRecord:
        """A volume of `team_id`, of `size_mb` (the node's default when None). Raises
        `BadMount` for a bad
        name, `catalog.VolumeNameTaken` for a taken one, `NoRoom` when the host's disk cannot
        hold it; nothing is left of a failed create."""
        check_name(name)
        size_mb = size_mb or self.default_size_mb
        record = VolumeRecord(
            new_volume_id(), name, new_access_token(), time.time(), size_mb, team_id
        )
        async with self._creating:
            free_mb, committed_mb = await asyncio.to_thread(self._disk_use)
            room_mb = free_mb - committed_mb - self.reserve.disk_mb
            if size_mb > room_mb:
                raise NoRoom(
                    f"not enough disk for a volume of {size_mb} MiB: the host's free disk above "
                    f"its reserve, less what existing volumes can still write, is "
                    f"{max(room_mb, 0)} MiB ({free_mb} MiB free, {committed_mb} MiB unwritten in "
                    f"volumes, {self.reserve.disk_mb} MiB reserved)"
                )
            self.catalog.insert_volume(record)
            try:
                await asyncio.to_thread(self.backing.make, record.id, size_mb)
            except Exception:
                self.catalog.delete_volume(record.id)
                raise
        return record

    def _disk_use(self) -> tuple[int, int]:
        """The host's free disk, and what sized volumes can still take of it (MiB)."""
        committed = sum(
            self.backing.unwritten_mb(v.id, v.size_mb) for v in self.list() if v.size_mb is not None
        )
        return self.reserve.free_disk_mb(), committed

    async def delete(self, volume_id: str, sandboxes: Iterable[SandboxRecord]) -> None:
        """Raises `VolumeNotFound`, or `VolumeInUse` naming the sandboxes that mount it (or
        saying its files are in use on the host)."""
        volume = self.get(volume_id)
        users = [s.id for s in sandboxes if any(m.volume_id == volume_id for m in s.volume_mounts)]
        if users:
            raise VolumeInUse(f"volume '{volume_id}' is mounted by sandbox {', '.join(users)}")
        if volume.size_mb is None:
            await asyncio.to_thread(shutil.rmtree, self.directory(volume_id), ignore_errors=True)
        else:
            try:
                await asyncio.to_thread(self.backing.destroy, volume_id)
            except VolumeBusy as e:
                raise VolumeInUse(str(e)) from e
        self.catalog.delete_volume(volume_id)
        self.unavailable.discard(volume_id)

    async def attach_all(self) -> None:
        """At the node's start: every sized volume mounted at its directory. One that cannot be
        is logged and `unavailable`: mounts of it are refused rather than let guests write into
        the bare directory beneath."""
        for volume in self.list():
            if volume.size_mb is None:
                log.warning(
                    "volume %s (%s) has no size: it was made before volume sizes, and its files "
                    "are bounded by the host's disk only",
                    volume.id,
                    volume.name,
                )
                continue
            try:
                await asyncio.to_thread(self.backing.attach, volume.id)
            except Exception:
                log.exception("volume %s: its image could not be mounted", volume.id)
                self.unavailable.add(volume.id)

    async def detach_all(self) -> None:
        """At the node's stop, once its VMs are gone: every sized volume unmounted. One still in
        use stays mounted, and the next start keeps it so."""
        for volume in self.list():
            if volume.size_mb is not None:
                try:
                    await asyncio.to_thread(self.backing.detach, volume.id)
                except Exception:
                    log.exception("volume %s: its image could not be unmounted", volume.id)

    def resolve(
        self, mounts: Iterable[tuple[str, str]], team_id: str = TEAM_ID
    ) -> tuple[VolumeMount, ...]:
        """(volume name, guest path) pairs, names of `team_id`'s volumes, as mounts; raises
        `VolumeNotFound` or `BadMount`."""
        resolved: list[VolumeMount] = []
        for name, path in mounts:
            normal = check_mount_path(path)
            if any(m.path == normal for m in resolved):
                raise BadMount(f"two volumes are mounted at '{normal}'")
            volume = self.named(name, team_id)
            if volume.id in self.unavailable:
                raise BadMount(str(VolumeUnavailable(name)))
            resolved.append(VolumeMount(volume.id, normal))
        if len(resolved) > MAX_MOUNTS:
            raise BadMount(f"at most {MAX_MOUNTS} volumes can be mounted into one sandbox")
        if resolved and self.no_shares:
            raise BadMount(f"volumes cannot be mounted on this node: {self.no_shares}")
        return tuple(resolved)

    def shares(self, mounts: Iterable[VolumeMount]) -> tuple[Share, ...]:
        """The driver's view of `mounts`; raises `VolumeNotFound` for a volume deleted since
        (`VolumeUnavailable` for one not mounted on the host)."""
        shares = []
        for i, m in enumerate(mounts):
            if m.volume_id in self.unavailable:
                raise VolumeUnavailable(m.volume_id)
            shares.append(Share(share_tag(i), self.directory(self.get(m.volume_id).id)))
        return tuple(shares)


def guest_mounts(mounts: tuple[VolumeMount, ...]) -> list[dict[str, str]]:
    """What envd's `/init` is told to mount: each device's tag and its guest path."""
    return [{"tag": share_tag(i), "path": m.path} for i, m in enumerate(mounts)]
