"""Volumes: named directories of the node that sandboxes mount into their guests and share.

A volume is a catalog row (`VolumeRecord`) and a directory `Paths.volumes/<id>`. The row is
written before the directory exists and removed after it is gone, so a crash in between leaves
a volume that lists and can be deleted again, never a directory nobody knows. A volume mounted
by a sandbox that still exists (running or paused) cannot be deleted: its guest would lose its
files under it.

How a mount reaches the guest is the driver's business (`runtime.driver.Share`); which paths
a guest may mount a volume at is decided here (`check_mount_path`).
"""

from __future__ import annotations

import asyncio
import fnmatch
import posixpath
import re
import secrets
import shutil
import time
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from aenv.ids import new_access_token
from aenv.orchestrator.catalog import Catalog, SandboxRecord, VolumeMount, VolumeRecord
from aenv.runtime.driver import Share, share_tag
from aenv.runtime.jail import SHARED_DIR_MODE

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


class VolumeInUse(RuntimeError):
    """The volume is mounted by sandboxes that still exist."""


class BadMount(ValueError):
    """A mount request the node refuses (a bad path, two mounts at one path)."""


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
    def __init__(self, catalog: Catalog, root: Path, no_shares: str | None = None) -> None:
        """`no_shares`: why the node's VMs cannot mount volumes (its driver's), if they cannot."""
        self.catalog = catalog
        self.root = root
        self.no_shares = no_shares

    def directory(self, volume_id: str) -> Path:
        return self.root / volume_id

    def list(self) -> list[VolumeRecord]:
        return self.catalog.volumes()

    def get(self, volume_id: str) -> VolumeRecord:
        found = self.catalog.volume(volume_id=volume_id)
        if found is None:
            raise VolumeNotFound(volume_id)
        return found

    def named(self, name: str) -> VolumeRecord:
        found = self.catalog.volume(name=name)
        if found is None:
            raise VolumeNotFound(name)
        return found

    async def create(self, name: str) -> VolumeRecord:
        """Raises `BadMount` for a bad name, `catalog.VolumeNameTaken` for a taken one."""
        check_name(name)
        record = VolumeRecord(new_volume_id(), name, new_access_token(), time.time())
        self.catalog.insert_volume(record)
        try:
            await asyncio.to_thread(self._make_directory, self.directory(record.id))
        except OSError:
            self.catalog.delete_volume(record.id)
            raise
        return record

    @staticmethod
    def _make_directory(path: Path) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(exist_ok=True)
        # Guest users of any uid write in it; the parent (0700) keeps host users out.
        path.chmod(SHARED_DIR_MODE)

    async def delete(self, volume_id: str, sandboxes: Iterable[SandboxRecord]) -> None:
        """Raises `VolumeNotFound`, or `VolumeInUse` naming the sandboxes that mount it."""
        self.get(volume_id)
        users = [s.id for s in sandboxes if any(m.volume_id == volume_id for m in s.volume_mounts)]
        if users:
            raise VolumeInUse(f"volume '{volume_id}' is mounted by sandbox {', '.join(users)}")
        await asyncio.to_thread(shutil.rmtree, self.directory(volume_id), ignore_errors=True)
        self.catalog.delete_volume(volume_id)

    def resolve(self, mounts: Iterable[tuple[str, str]]) -> tuple[VolumeMount, ...]:
        """(volume name, guest path) pairs as mounts; raises `VolumeNotFound` or `BadMount`."""
        resolved: list[VolumeMount] = []
        for name, path in mounts:
            normal = check_mount_path(path)
            if any(m.path == normal for m in resolved):
                raise BadMount(f"two volumes are mounted at '{normal}'")
            resolved.append(VolumeMount(self.named(name).id, normal))
        if len(resolved) > MAX_MOUNTS:
            raise BadMount(f"at most {MAX_MOUNTS} volumes can be mounted into one sandbox")
        if resolved and self.no_shares:
            raise BadMount(f"volumes cannot be mounted on this node: {self.no_shares}")
        return tuple(resolved)

    def shares(self, mounts: Iterable[VolumeMount]) -> tuple[Share, ...]:
        """The driver's view of `mounts`; raises `VolumeNotFound` for a volume deleted since."""
        return tuple(
            Share(share_tag(i), self.directory(self.get(m.volume_id).id))
            for i, m in enumerate(mounts)
        )


def guest_mounts(mounts: tuple[VolumeMount, ...]) -> list[dict[str, str]]:
    """What envd's `/init` is told to mount: each device's tag and its guest path."""
    return [{"tag": share_tag(i), "path": m.path} for i, m in enumerate(mounts)]
