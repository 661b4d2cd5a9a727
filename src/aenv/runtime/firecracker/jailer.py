"""Running Firecracker under its jailer: the chroot layout, the files put into it, the jailer's
command line (uid/gid, cgroups, resource limits, network namespace) and the cleanup afterwards.

The jailer builds `<chroot_base>/<exec file name>/<id>/root`, copies the firecracker binary in,
creates the cgroup `<cgroup mount>/<parent cgroup>/<id>` with the values given by `--cgroup`,
joins the network namespace, pivots into the chroot, drops to uid/gid and execs Firecracker.
Everything Firecracker opens (kernel, drives, snapshot files, guest memory) must therefore be inside
the chroot. A file on the chroot's filesystem is hard-linked in (a copy would be slow for memory
files and wrong for writable disks, whose writes must land in the sandbox's own layer). A file on
another filesystem (the default layout: guest memory on tmpfs, disks under `$AENV_HOME`, jails
under /srv/jailer) is bind-mounted onto an empty file in the chroot before the jailer starts. The
jailer carries such mounts into the jail: it unshares a mount namespace (a copy of ours, with the
binds), makes it a recursive slave and bind-mounts the chroot onto itself with `MS_BIND | MS_REC`
before `pivot_root` (firecracker `src/jailer/src/chroot.rs`), so submounts of the chroot stay
visible at the same paths. Every mount is undone before the jail is deleted (`Jail.remove`, also
from the startup sweep): a tree is never removed through a mount.

Files Firecracker writes (snapshot state and memory) are given to it as their destination
itself: hard-linked into the jail, or bind-mounted where the chroot's mount propagates new mounts
to the jail's copy (a shared mount, as systemd makes `/`). Where it does not (a private mount
tree), a mount made after the jailer started would not reach the jail, so Firecracker writes in
the jail and the file is moved out, a copy across filesystems.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal

from aenv import mounts
from aenv.runtime.firecracker.process import netns_path
from aenv.runtime.jail import Access, JailFile, grant
from aenv.runtime.jail import JailError as RuntimeJailError

DEFAULT_CHROOT_BASE = Path("/srv/jailer")
# The in-jail path of the API socket; the host sees it at `<chroot>/api.sock`.
JAIL_SOCKET = "/api.sock"
CPU_PERIOD_US = 100_000


class JailError(RuntimeJailError):
    """The jail could not be prepared (a file that can be neither linked, bound nor given to
    the jailed uid, a failed mount)."""


@dataclass(frozen=True)
class JailerConfig:
    binary: Path
    uid: int
    gid: int
    chroot_base_dir: Path = DEFAULT_CHROOT_BASE
    cgroup_version: Literal[1, 2] = 2
    # The jailer's default is the exec file's name ("firecracker").
    parent_cgroup: str | None = None
    # `--resource-limit` values, e.g. {"no-file": 2048, "fsize": 20 << 30}.
    resource_limits: Mapping[str, int] = field(default_factory=dict)


def cgroup_settings(
    version: Literal[1, 2], *, memory_bytes: int | None, pids: int | None, cpu_cores: float | None
) -> dict[str, str]:
    """The `--cgroup file=value` pairs that enforce the limits in the given hierarchy version."""
    out: dict[str, str] = {}
    if memory_bytes is not None:
        out["memory.limit_in_bytes" if version == 1 else "memory.max"] = str(memory_bytes)
    if pids is not None:
        out["pids.max"] = str(pids)
    if cpu_cores is not None:
        quota = str(int(cpu_cores * CPU_PERIOD_US))
        if version == 1:
            out["cpu.cfs_period_us"] = str(CPU_PERIOD_US)
            out["cpu.cfs_quota_us"] = quota
        else:
            out["cpu.max"] = f"{quota} {CPU_PERIOD_US}"
    return out


class Jail:
    """The chroot of one jailed Firecracker, named by the VM id."""

    def __init__(self, config: JailerConfig, vm_id: str, firecracker: Path) -> None:
        if not vm_id or len(vm_id) > 64 or not all(c.isalnum() or c == "-" for c in vm_id):
            # The jailer's own rule for --id.
            raise JailError(f"jailer id must be 1-64 alphanumerics or '-': {vm_id!r}")
        self.config = config
        self.vm_id = vm_id
        self.firecracker = firecracker
        self.instance_dir = config.chroot_base_dir / firecracker.name / vm_id
        self.root = self.instance_dir / "root"

    @property
    def socket_path(self) -> Path:
        return self.host_path(JAIL_SOCKET)

    def host_path(self, inside: str) -> Path:
        """Where the jailed process's `inside` path is on the host."""
        relative = PurePosixPath(inside).relative_to("/") if inside.startswith("/") else inside
        return self.root / relative

    def create(self) -> None:
        if self.instance_dir.exists():
            raise JailError(f"jail {self.instance_dir} already exists (id reused?)")
        self.root.mkdir(parents=True)

    def link_in(
        self, source: Path, inside: str, *, writable: bool = False, copy_if_needed: bool = False
    ) -> str:
        """Put `source` at `inside` in the jail: a hard link, or a bind mount from another
        filesystem (read-only unless `writable`); returns `inside` as Firecracker must be told.
        A `writable` file is handed to the jailed uid (link and mount share the inode, so this
        owns the original: it must be this VM's own file). A read-only one that the jailed uid
        cannot read yet (the node keeps its files 0600) is given to root and the jail's group
        with group read, as QEMU's jails do (`aenv.runtime.jail.grant`); its directories keep
        their modes. `copy_if_needed`: a small read-only file is copied when it can be neither
        linked nor bound."""
        if not writable and not self._can_read(source):
            try:
                grant([JailFile(source, Access.READ)], uid=self.config.uid, gid=self.config.gid)
            except RuntimeJailError as exc:
                raise JailError(str(exc)) from exc
        target = self.host_path(inside)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._link_or_bind(source, target, read_only=not writable)
        except JailError:
            if not copy_if_needed or writable:
                raise
            shutil.copy2(source, target)
        if writable:
            os.chown(source, self.config.uid, self.config.gid)
        return inside

    def output(self, inside: str, destination: Path) -> str:
        """The path to tell Firecracker for a file it writes that must end at `destination`:
        `destination` itself, made empty for the jailed uid and put at `inside`, where the jail
        can see it while running; else `inside` alone, for `take_out` to move."""
        target = self.host_path(inside)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.chown(target.parent, self.config.uid, self.config.gid)
        existed = destination.exists()
        destination.touch()
        os.chown(destination, self.config.uid, self.config.gid)
        try:
            os.link(destination, target)
        except OSError as exc:
            if exc.errno != errno.EXDEV or not mounts.is_shared(self.root):
                if not existed:
                    destination.unlink()
                return inside
            target.touch()
            self._bind(destination, target, read_only=False)
        return inside

    def _link_or_bind(self, source: Path, target: Path, *, read_only: bool) -> None:
        try:
            os.link(source, target)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise JailError(f"cannot hard-link {source} into jail {self.root}: {exc}") from exc
            target.touch()
            self._bind(source, target, read_only=read_only)

    def _bind(self, source: Path, target: Path, *, read_only: bool) -> None:
        try:
            mounts.bind(source, target, read_only=read_only)
        except mounts.MountError as exc:
            target.unlink(missing_ok=True)
            raise JailError(f"cannot bind-mount {source} into jail {self.root}: {exc}") from exc

    def _can_read(self, path: Path) -> bool:
        st = path.stat()
        if st.st_uid == self.config.uid:
            return bool(st.st_mode & stat.S_IRUSR)
        if st.st_gid == self.config.gid:
            return bool(st.st_mode & stat.S_IRGRP)
        return bool(st.st_mode & stat.S_IROTH)

    def take_out(self, inside: str, destination: Path) -> Path:
        """Bring a file Firecracker wrote at `inside` (see `output`) to `destination`."""
        target = self.host_path(inside)
        if mounts.mounts_under(target.resolve()):
            mounts.unmount_under(target.resolve())
            target.unlink()
        elif destination.exists() and target.samefile(destination):
            target.unlink()
        else:
            shutil.move(target, destination)
        return destination

    def argv(
        self,
        *,
        netns: str | None,
        cgroups: Mapping[str, str],
        firecracker_args: Sequence[str] = (),
    ) -> list[str]:
        c = self.config
        argv = [
            str(c.binary),
            "--id",
            self.vm_id,
            "--exec-file",
            str(self.firecracker),
            "--uid",
            str(c.uid),
            "--gid",
            str(c.gid),
            "--chroot-base-dir",
            str(c.chroot_base_dir),
            "--cgroup-version",
            str(c.cgroup_version),
        ]
        if c.parent_cgroup is not None:
            argv += ["--parent-cgroup", c.parent_cgroup]
        for name, value in cgroups.items():
            argv += ["--cgroup", f"{name}={value}"]
        for name, limit in c.resource_limits.items():
            argv += ["--resource-limit", f"{name}={limit}"]
        if netns is not None:
            argv += ["--netns", str(netns_path(netns))]
        return [*argv, "--", "--api-sock", JAIL_SOCKET, *firecracker_args]

    def cgroup_dirs(self, cgroups: Mapping[str, str], mounts: str) -> list[Path]:
        """The cgroup directories the jailer creates for this VM, found as the jailer finds them:
        from the cgroup mounts in `mounts` (the text of /proc/mounts)."""
        if self.config.cgroup_version == 2 and not cgroups:
            # Without --cgroup a v2 jailer makes no group of its own (it joins the parent).
            return []
        parent = self.config.parent_cgroup or self.firecracker.name
        controllers = {name.split(".", 1)[0] for name in cgroups}
        dirs: list[Path] = []
        for line in mounts.splitlines():
            fields = line.split()
            if len(fields) < 4:
                continue
            mount_point, fstype, options = fields[1], fields[2], fields[3].split(",")
            if self.config.cgroup_version == 2 and fstype == "cgroup2":
                return [Path(mount_point) / parent / self.vm_id]
            if (
                self.config.cgroup_version == 1
                and fstype == "cgroup"
                and controllers & set(options)
            ):
                dirs.append(Path(mount_point) / parent / self.vm_id)
        return dirs

    def remove(self, cgroups: Mapping[str, str]) -> None:
        """Delete the jail and the cgroups the jailer made; the process must have exited.
        Blocking (unmounts, tree removal, cgroup retries): run it in a thread."""
        if self.instance_dir.exists():
            try:
                mounts.unmount_under(self.instance_dir.resolve())
            except mounts.MountError as exc:
                raise JailError(f"jail {self.instance_dir} stays: {exc}") from exc
            shutil.rmtree(self.instance_dir, ignore_errors=True)
        try:
            proc_mounts = Path("/proc/mounts").read_text()
        except OSError:
            return
        for directory in self.cgroup_dirs(cgroups, proc_mounts):
            _rmdir_cgroup(directory)


def sweep_jails(
    config: JailerConfig, exec_name: str, prefix: str, keep: Collection[str] = ()
) -> list[Path]:
    """Remove the jails (and the cgroups the jailer made for them) under
    `<chroot_base>/<exec_name>/` whose id starts with `prefix`, except those in `keep`: what a
    killed process left. Their Firecrackers must have exited. Returns what was removed."""
    base = config.chroot_base_dir / exec_name
    if not base.is_dir():
        return []
    try:
        proc_mounts = Path("/proc/mounts").read_text()
    except OSError:
        proc_mounts = ""
    # The driver always sets all three limits, so the jailer made a group in every hierarchy.
    settings = cgroup_settings(config.cgroup_version, memory_bytes=1, pids=1, cpu_cores=1.0)
    removed: list[Path] = []
    for instance in sorted(base.iterdir()):
        vm_id = instance.name
        if not instance.is_dir() or not vm_id.startswith(prefix) or vm_id in keep:
            continue
        try:
            jail = Jail(config, vm_id, Path(exec_name))
        except JailError:
            continue  # not a name the driver gives out
        cgroups = [d for d in jail.cgroup_dirs(settings, proc_mounts) if d.is_dir()]
        try:
            jail.remove(settings)
        except JailError:
            continue  # a mount that would not go: never delete through it
        removed += [p for p in (instance, *cgroups) if not p.exists()]
    return removed


def _rmdir_cgroup(directory: Path) -> None:
    # The kernel may take a moment to notice that a just-reaped process has left the group.
    for _ in range(50):
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
