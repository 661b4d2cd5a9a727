"""The jail every QEMU runs in: its own user id, no capabilities, no new privileges, QEMU's
seccomp filter, and its own mount, network and IPC namespaces.

One uid per VMM process, from a configured range (`JailConfig`), not one per node: a VMM that
escapes the emulator can then neither signal nor ptrace another sandbox's VMM, nor open its
files through /proc; one uid for all would share all of that. (Firecracker's jailer takes its
uid from the same kind of pool: `FirecrackerConfig.jail_uids`.) Uids are handed out by this
process (`UidPool`) and come back when the VMM is stopped; run one node per host, or give each
node its own range, or two nodes may hand out the same uid. Every jailed VMM has the range's
first id as its group (`JailConfig.gid`) and no supplementary groups (plus the group of
`/dev/kvm` under KVM, which it must open).

How a VMM is started (`Jail.assemble`):
1. A fresh thread of ours unshares its mount, network and IPC namespaces, mounts a small tmpfs
   and bind-mounts into it, at their host paths, exactly the files the VMM needs (below), then
   pivots into it: the namespace holds nothing else.
2. The VMM is started as `nsenter` (joins that thread's namespaces) -> `setpriv` (drops to the
   VMM's uid and gid, clears groups, capabilities and the bounding set, sets no_new_privs) ->
   QEMU with `-sandbox` (`SECCOMP`), which installs its seccomp filter before the guest runs.
3. Its tap is an open file passed in (`aenv.network.tap`), so the empty network namespace does
   not matter to the guest, and the VMM itself reaches no address at all.
Files opened later by path (the new disk top of a snapshot that keeps running) are added to the
running VMM's namespace by `Jail.expose`.

What a VMM sees, and may do with it (each file bind-mounted at its own host path):
- read-only: `/usr` (QEMU, its libraries and firmware) and the usrmerge links to it, the
  `/dev` nodes null, zero, full, random, urandom (and kvm under KVM);
- read (`Access.READ`, owner root, group `gid` with read): the kernel, the initrd, read-only
  disks (template base, envd bundle), every layer below a writable disk's top, and the empty
  directory that unused share slots export (`qemu.cmdline.EMPTY_SHARE`);
- read and write, shared (`Access.SHARED_WRITE`, owner root, group `gid` with read and write):
  the memory file of the snapshot it was restored from. It maps it privately and never writes
  to it, but QEMU 7.2 opens every `memory-backend-file` read-write (read-only opening with a
  private mapping, `rom=off`, came in 8.2): a VMM that escaped could therefore write into the
  memory file of its own snapshot, which later restores of that snapshot map;
- read, write and create in, shared (`Access.SHARED_DIR`, owner root, mode 0777: VMMs of other
  uids, and guest users of any uid, create and remove files in it): the directory of a volume it
  mounts (a 9p share). What a VMM creates there is its uid's, readable and writable by all
  (`qemu.cmdline.SHARE_FILE_MODES`). QEMU's 9p server sets attributes through `/proc/self/fd`, so
  such a VMM also gets a /proc that shows its own processes alone (`PROC_OPTIONS`);
- read and write, its own (`Access.OWN`, owner its uid, mode 0600): its writable disk tops, its
  own memory file, its console log and its QMP socket.
Files are made accessible by owner and group on the file itself; their directories keep their
modes (0700, root), so users of the host reach none of them, and a VMM only what is mounted into
its jail. State files are never in a jail: they are opened by the driver and handed over QMP.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import enum
import os
import secrets
import shutil
import stat
import threading
from collections.abc import AsyncIterator, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from aenv.network import netns
from aenv.storage.volume_images import SHARED_DIR_MODE

# The /proc of a VMM that serves a 9p share: its own processes only (each VMM has its own uid),
# and no system files (`subset=pid`).
PROC_OPTIONS = "hidepid=invisible,subset=pid"
SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
# Where a jail's root is put together, inside its own mount namespace only (the host sees an
# empty directory).
ASSEMBLY_POINT = Path("/run/aenv/jail")
SYSTEM_DIRS = (Path("/usr"),)
SYSTEM_LINKS = tuple(Path(p) for p in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"))
DEVICES = tuple(Path("/dev") / d for d in ("null", "zero", "full", "random", "urandom"))
KVM_DEVICE = Path("/dev/kvm")
DEFAULT_UID_BASE = 2_000_000
DEFAULT_UID_COUNT = 65_536

_CLONE_NEWNS = 0x00020000
_CLONE_FS = 0x00000200
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY = 0x1
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_NOEXEC = 0x8
_MS_REMOUNT = 0x20
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 0x40000
_MNT_DETACH = 2
_AT_FDCWD = -100
_OPEN_TREE_CLONE = 1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_MOVE_MOUNT_F_EMPTY_PATH = 4
# x86_64 and the generic table (arm64) agree on the numbers of these newer calls.
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429

_libc = ctypes.CDLL(None, use_errno=True)


class JailError(RuntimeError):
    """A jail could not be set up (no free uid, a mount or an ownership change failed)."""


class Access(enum.Enum):
    READ = "read"
    SHARED_WRITE = "shared-write"
    OWN = "own"
    SHARED_DIR = "shared-dir"


@dataclass(frozen=True)
class JailFile:
    path: Path
    access: Access


@dataclass(frozen=True)
class JailConfig:
    """`uid_base` is the group of every jailed VMM; `uid_base + 1 ..` (`uid_count` ids) are
    their users."""

    uid_base: int = DEFAULT_UID_BASE
    uid_count: int = DEFAULT_UID_COUNT

    @property
    def gid(self) -> int:
        return self.uid_base


class UidPool:
    """The uids of this process's running VMMs, one each. Allocation starts at a random place
    in the range, so that two processes sharing a range (tests next to a node) rarely meet."""

    def __init__(self, config: JailConfig) -> None:
        if config.uid_base <= 0 or config.uid_count <= 0:
            raise JailError("the jail's uid range must be positive")
        self._config = config
        self._used: set[int] = set()
        self._next = secrets.randbelow(config.uid_count)

    def acquire(self) -> int:
        count = self._config.uid_count
        for step in range(count):
            index = (self._next + step) % count
            uid = self._config.uid_base + 1 + index
            if uid not in self._used:
                self._used.add(uid)
                self._next = (index + 1) % count
                return uid
        raise JailError(f"all {count} jail uids are in use")

    def release(self, uid: int) -> None:
        self._used.discard(uid)


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _mount(
    source: str | None, target: Path, fstype: str | None, flags: int, data: str = ""
) -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            bytes(target),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {source or ''} on {target}",
    )


def _bind(source: Path, target: Path, *, read_only: bool, recursive: bool = False) -> None:
    """Bind `source` onto `target` (created as an empty file or directory), with no set-uid
    programs or device files honoured, and read-only when asked."""
    if source.is_dir():
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch(exist_ok=True)
    _mount(str(source), target, None, _MS_BIND | (_MS_REC if recursive else 0))
    flags = _MS_BIND | _MS_REMOUNT | _MS_NOSUID | _MS_NODEV | (_MS_RDONLY if read_only else 0)
    _mount(None, target, None, flags)


def _inside(root: Path, path: Path) -> Path:
    return root / path.relative_to("/")


def _covered(path: Path) -> bool:
    return any(path.is_relative_to(d) for d in SYSTEM_DIRS)


def _build_root(root: Path, files: Sequence[JailFile], devices: Sequence[Path]) -> None:
    """Steps of the jail's root, in a thread that has its own mount namespace already."""
    _mount(None, Path("/"), None, _MS_REC | _MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "mode=0755,size=1m")
    for directory in SYSTEM_DIRS:
        _bind(directory, _inside(root, directory), read_only=True, recursive=True)
    for link in SYSTEM_LINKS:
        if link.is_symlink():
            _inside(root, link).symlink_to(os.readlink(link))
        elif link.is_dir():
            _bind(link, _inside(root, link), read_only=True, recursive=True)
    for device in devices:
        target = _inside(root, device)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
        _mount(str(device), target, None, _MS_BIND)
    for file in files:
        if not _covered(file.path):
            _bind(file.path, _inside(root, file.path), read_only=file.access is Access.READ)
    if any(file.access is Access.SHARED_DIR for file in files):
        (root / "proc").mkdir()
        _mount("proc", root / "proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, PROC_OPTIONS)
    old = root / ".old"
    old.mkdir()
    _check(_libc.syscall(_pivot_root_number(), bytes(root), bytes(old)), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", _MNT_DETACH), "umount the host's root")
    os.rmdir("/.old")


def _pivot_root_number() -> int:
    machine = os.uname().machine
    if machine not in _SYS_PIVOT_ROOT:
        raise JailError(f"no jail on {machine}")
    return _SYS_PIVOT_ROOT[machine]


def grant(files: Iterable[JailFile], uid: int, gid: int) -> None:
    """Give the VMM `uid` (group `gid`) exactly the access `files` ask for. Blocking."""
    for file in files:
        try:
            if file.access is Access.OWN:
                os.chown(file.path, uid, gid)
                os.chmod(file.path, 0o600)
                continue
            if file.access is Access.SHARED_DIR:
                os.chown(file.path, 0, gid)
                os.chmod(file.path, SHARED_DIR_MODE)
                continue
            st = os.stat(file.path)
            if st.st_uid != 0 or st.st_gid != gid:
                # Not a VMM's any more (a sealed layer, a handed-over memory file): root's, so
                # that a later holder of the same uid has no owner's rights on it.
                os.chown(file.path, 0, gid)
            wanted = 0o040 if file.access is Access.READ else 0o060
            if stat.S_IMODE(st.st_mode) & wanted != wanted:
                os.chmod(file.path, stat.S_IMODE(st.st_mode) | wanted)
        except OSError as exc:
            raise JailError(f"cannot give the VMM access to {file.path}: {exc}") from exc


def host_binary(name: str) -> Path:
    """The absolute path of a program, which the jail shows at the same path (only programs
    under `SYSTEM_DIRS` can run jailed: their libraries must be there too)."""
    found = shutil.which(name)
    if found is None:
        raise JailError(f"{name} not found")
    if not _covered(Path(found)):
        raise JailError(f"{found} is outside {', '.join(map(str, SYSTEM_DIRS))}: cannot run jailed")
    return Path(found)


class Jail:
    """The jail of one VMM process: its uid, and its namespaces once `assemble` made them."""

    def __init__(self, uid: int, gid: int, *, kvm: bool = False) -> None:
        self.uid = uid
        self.gid = gid
        self.kvm = kvm

    def _devices(self) -> list[Path]:
        devices = [d for d in DEVICES if d.exists()]
        return [*devices, KVM_DEVICE] if self.kvm else devices

    def _groups(self) -> str:
        if not self.kvm:
            return "--clear-groups"
        return f"--groups={KVM_DEVICE.stat().st_gid}"

    @contextlib.asynccontextmanager
    async def assemble(self, files: Sequence[JailFile]) -> AsyncIterator[list[str]]:
        """Make the jail's namespaces with `files` in them, and yield the command that runs a
        program inside as the jail's uid: prefix the VMM's command line with it. The namespaces
        are held by a thread of ours until the context exits; by then the VMM must have joined
        them (it has once it answered anything)."""
        await asyncio.to_thread(grant, files, self.uid, self.gid)
        devices = self._devices()
        built: Future[int] = Future()
        release = threading.Event()

        def body() -> None:
            try:
                _check(_libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC), "unshare")
                _build_root(ASSEMBLY_POINT, files, devices)
                built.set_result(threading.get_native_id())
            except BaseException as exc:  # not a rollback: any error must reach the awaiter
                built.set_exception(exc)
                return
            release.wait()

        await asyncio.to_thread(ASSEMBLY_POINT.mkdir, mode=0o700, parents=True, exist_ok=True)
        thread = threading.Thread(target=body, name=f"jail:{self.uid}", daemon=True)
        thread.start()
        try:
            try:
                tid = await asyncio.wrap_future(built)
            except OSError as exc:
                raise JailError(f"cannot build the jail: {exc}") from exc
            task = Path(f"/proc/{os.getpid()}/task/{tid}/ns")
            yield [
                str(host_binary("nsenter")),
                f"--mount={task / 'mnt'}",
                f"--net={task / 'net'}",
                f"--ipc={task / 'ipc'}",
                "--",
                str(host_binary("setpriv")),
                f"--reuid={self.uid}",
                f"--regid={self.gid}",
                self._groups(),
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--no-new-privs",
                "--",
            ]
        finally:
            release.set()
            await asyncio.to_thread(thread.join)

    async def expose(self, pid: int, file: JailFile) -> None:
        """Add `file` to the running jailed process `pid`'s namespace, at its host path."""
        await asyncio.to_thread(grant, [file], self.uid, self.gid)

        def body() -> None:
            tree = _check(
                _libc.syscall(
                    _SYS_OPEN_TREE,
                    _AT_FDCWD,
                    bytes(file.path),
                    _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC,
                ),
                f"open_tree {file.path}",
            )
            try:
                ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    # setns(CLONE_NEWNS) needs a thread with a filesystem context of its own.
                    _check(_libc.unshare(_CLONE_FS), "unshare(CLONE_FS)")
                    _check(_libc.setns(ns, _CLONE_NEWNS), "setns")
                finally:
                    os.close(ns)
                target = file.path  # now resolved inside the jail
                target.parent.mkdir(parents=True, exist_ok=True)
                target.touch(exist_ok=True)
                _check(
                    _libc.syscall(
                        _SYS_MOVE_MOUNT,
                        tree,
                        b"",
                        _AT_FDCWD,
                        bytes(target),
                        _MOVE_MOUNT_F_EMPTY_PATH,
                    ),
                    f"move_mount {file.path}",
                )
                read_only = _MS_RDONLY if file.access is Access.READ else 0
                flags = _MS_BIND | _MS_REMOUNT | _MS_NOSUID | _MS_NODEV | read_only
                _mount(None, target, None, flags)
            finally:
                os.close(tree)

        try:
            # A fresh thread that dies afterwards: `body` changes its namespaces.
            await netns.run_in(None, body)
        except OSError as exc:
            raise JailError(f"cannot add {file.path} to the jail of {pid}: {exc}") from exc
