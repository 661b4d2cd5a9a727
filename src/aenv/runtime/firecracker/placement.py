"""Where one Firecracker VM's files are, as the host sees them and as Firecracker is told, and how
its process is confined: directly in the VM's workdir with a cgroup from `aenv.runtime.cgroups`,
or inside a jailer chroot with the jailer's cgroup.

Firecracker records drive paths in a snapshot's state file and opens them again, as recorded, when
the snapshot is loaded. So drives are always named `drives/<drive_id>`, relative to the process's
working directory (the workdir, or the jail's root), and every VM stages its own files under those
names: a clone opens its own writable layer through the path its source recorded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from aenv.runtime.cgroups import Cgroup, CgroupLimits, CgroupManager
from aenv.runtime.firecracker.jailer import Jail, cgroup_settings
from aenv.runtime.firecracker.process import direct_argv

API_SOCKET = "api.sock"


def drive_name(drive_id: str) -> str:
    return f"drives/{drive_id}"


class Placement(Protocol):
    @property
    def socket_path(self) -> Path: ...

    @property
    def cwd(self) -> Path: ...

    def stage(
        self, source: Path, name: str, *, writable: bool = False, may_copy: bool = False
    ) -> str:
        """Make `source` visible to Firecracker as `name`; returns the path to tell it. Called
        before the process starts: a jail's bind mounts made later would not reach it.
        `writable`: Firecracker opens it read-write. `may_copy`: a small read-only file that may
        be copied if it can be neither linked nor bound."""
        ...

    def output_path(self, name: str, destination: Path) -> str:
        """The path to tell Firecracker for a file it writes that must end up at `destination`."""
        ...

    def log_path(self, path: Path) -> str:
        """The path to tell Firecracker for a log file the host reads at `path` (in the workdir)."""
        ...

    def host_socket(self, name: str) -> tuple[Path, str]:
        """A unix socket the host listens on and Firecracker connects to (a `Uffd` handler's):
        where the host binds it, and the path to tell Firecracker."""
        ...

    def open_to_vmm(self, path: Path) -> None:
        """Let Firecracker connect to the socket the host bound at `host_socket(...)[0]`."""
        ...

    def collect(self, name: str, destination: Path) -> None:
        """Bring a file written at `output_path(name, destination)` to `destination`."""
        ...

    def argv(self, netns: str | None, limits: CgroupLimits) -> list[str]: ...

    def confine(self, pid: int, limits: CgroupLimits) -> None:
        """Put the started process under `limits` (if `argv` did not already)."""
        ...

    def release(self) -> None:
        """Remove what this placement created (links, cgroup, jail); the process has exited.
        Blocking: run it in a thread."""
        ...


class DirectPlacement:
    """Firecracker runs in `workdir` as this user; staged files are symlinks in `workdir`."""

    def __init__(
        self,
        workdir: Path,
        vm_id: str,
        binary: Path,
        cgroups: CgroupManager,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.workdir = workdir
        self.vm_id = vm_id
        self.binary = binary
        self.extra_args = tuple(extra_args)
        self._cgroups = cgroups
        self._cgroup: Cgroup | None = None
        self._staged: list[Path] = []

    @property
    def socket_path(self) -> Path:
        return self.workdir / API_SOCKET

    @property
    def cwd(self) -> Path:
        return self.workdir

    def stage(
        self, source: Path, name: str, *, writable: bool = False, may_copy: bool = False
    ) -> str:
        link = self.workdir / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(source.resolve())
        self._staged.append(link)
        return name

    def output_path(self, name: str, destination: Path) -> str:
        return str(destination)

    def log_path(self, path: Path) -> str:
        return str(path)

    def host_socket(self, name: str) -> tuple[Path, str]:
        return self.workdir / name, name

    def open_to_vmm(self, path: Path) -> None:
        return None  # Firecracker runs as this user

    def collect(self, name: str, destination: Path) -> None:
        return None

    def argv(self, netns: str | None, limits: CgroupLimits) -> list[str]:
        return direct_argv(
            self.binary,
            socket_path=self.socket_path,
            vm_id=self.vm_id,
            netns=netns,
            extra_args=self.extra_args,
        )

    def confine(self, pid: int, limits: CgroupLimits) -> None:
        self._cgroup = self._cgroups.create(self.vm_id, limits)
        self._cgroup.add(pid)

    def release(self) -> None:
        for link in self._staged:
            link.unlink(missing_ok=True)
            if link.parent != self.workdir:
                with contextlib.suppress(OSError):
                    link.parent.rmdir()
        self._staged.clear()
        if self._cgroup is not None:
            self._cgroup.remove()
            self._cgroup = None


class JailedPlacement:
    """Firecracker runs chrooted in the jail's root as the jail's uid; files are hard-linked or
    bind-mounted in (`Jail.link_in`). `on_release` runs once the jail is removed (it gives the
    jail's uid back)."""

    def __init__(
        self,
        jail: Jail,
        extra_args: Sequence[str] = (),
        on_release: Callable[[], None] = lambda: None,
    ) -> None:
        self.jail = jail
        self.extra_args = tuple(extra_args)
        self._cgroup_settings: Mapping[str, str] = {}
        self._on_release = on_release
        jail.create()

    @property
    def socket_path(self) -> Path:
        return self.jail.socket_path

    @property
    def cwd(self) -> Path:
        return self.jail.root

    def stage(
        self, source: Path, name: str, *, writable: bool = False, may_copy: bool = False
    ) -> str:
        return self.jail.link_in(source, name, writable=writable, copy_if_needed=may_copy)

    def output_path(self, name: str, destination: Path) -> str:
        return self.jail.output(f"out/{name}", destination)

    def log_path(self, path: Path) -> str:
        return self.jail.link_in(path, path.name, writable=True)

    def host_socket(self, name: str) -> tuple[Path, str]:
        return self.jail.host_path(name), name

    def open_to_vmm(self, path: Path) -> None:
        # Connecting needs write permission on the socket: the jailed uid's own socket.
        os.chown(path, self.jail.config.uid, self.jail.config.gid)

    def collect(self, name: str, destination: Path) -> None:
        self.jail.take_out(f"out/{name}", destination)

    def argv(self, netns: str | None, limits: CgroupLimits) -> list[str]:
        self._cgroup_settings = cgroup_settings(
            self.jail.config.cgroup_version,
            memory_bytes=limits.memory_bytes,
            pids=limits.pids,
            cpu_cores=limits.cpu_cores,
        )
        return self.jail.argv(
            netns=netns, cgroups=self._cgroup_settings, firecracker_args=self.extra_args
        )

    def confine(self, pid: int, limits: CgroupLimits) -> None:
        return None  # the jailer applied `--cgroup` before exec

    def release(self) -> None:
        self.jail.remove(self._cgroup_settings)
        self._on_release()
