"""The files of a volume, read and written by the host for E2B's volume content API.

Guests write into volumes, the server is root: every path is opened with `beneath.open_beneath`
(nothing followed, nothing out of the volume) and every entry is checked before its content
is touched. Entries are what guests see (`volume_entries`): those that are not `served` (a
guest's or the host's symlink, FIFO or device, a file with several hard links) are listed but
never read, written or changed through: `Problem.REFUSED`.

Writes go to a new file beside the target, renamed over it once complete: a failed upload
leaves the old content. Calls block: run them in a thread.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace
from enum import Enum
from pathlib import Path

from aenv.orchestrator.volume_entries import Entry, EntryType, Owner, entry_at, set_mapped
from aenv.storage.beneath import open_beneath

MAX_PATH = 4096
MAX_DEPTH = 32
MAX_LISTING = 10_000
# Modes of what the host creates: every VMM (each with its own uid) reads and writes volume
# files, as `runtime.qemu.SHARE_FILE_MODES` has it for what they create themselves.
_FILE_MODE = 0o666
_DIR_MODE = 0o777
_UPLOAD_MARK = ".aenv-upload-"


class Problem(Enum):
    NOT_FOUND = "not found"
    REFUSED = "refused"
    CONFLICT = "conflict"
    NO_SPACE = "no space"


class VolumePathError(Exception):
    def __init__(self, problem: Problem, message: str) -> None:
        super().__init__(message)
        self.problem = problem


def relative(path: str) -> str:
    """`path` (absolute in the volume or relative to its root) as a relative path, "" for the
    root. Raises `VolumePathError` (refused) for `..`, NUL or an overlong path."""
    if "\0" in path or len(path) > MAX_PATH:
        raise VolumePathError(Problem.REFUSED, "path must be at most 4096 bytes without NUL")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise VolumePathError(Problem.REFUSED, f"path '{path}' must not contain '..'")
    return "/".join(parts)


def _shown(rel: str) -> str:
    return "/" + rel


def _failure(err: OSError, rel: str) -> VolumePathError:
    where = _shown(rel)
    if err.errno == errno.ENOENT:
        return VolumePathError(Problem.NOT_FOUND, f"path '{where}' not found")
    if err.errno == errno.ELOOP:
        return VolumePathError(Problem.REFUSED, f"path '{where}' goes through a symlink")
    if err.errno == errno.EXDEV:
        return VolumePathError(Problem.REFUSED, f"path '{where}' leaves the volume")
    if err.errno == errno.ENOTDIR:
        return VolumePathError(Problem.REFUSED, f"path '{where}' goes through a non-directory")
    if err.errno == errno.ENAMETOOLONG:
        return VolumePathError(Problem.REFUSED, f"path '{where}' has a name over 255 bytes")
    if err.errno == errno.EISDIR:
        return VolumePathError(Problem.REFUSED, f"path '{where}' is a directory")
    if err.errno == errno.EEXIST:
        return VolumePathError(Problem.CONFLICT, f"path '{where}' already exists")
    if err.errno == errno.ENOTEMPTY:
        return VolumePathError(Problem.CONFLICT, f"path '{where}' is not empty")
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return VolumePathError(Problem.NO_SPACE, f"no space left for '{where}'")
    raise err


def _refusal(entry: Entry) -> VolumePathError:
    if entry.type is EntryType.FILE:
        why = "has more than one hard link"
    elif entry.type is EntryType.SYMLINK:
        why = "is a symlink, which is never followed"
    else:
        why = "is not a regular file or directory"
    return VolumePathError(Problem.REFUSED, f"path '{entry.path}' {why}")


@contextmanager
def _fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


class VolumeFiles:
    """The content of the volumes under `root` (a directory `<root>/<volume id>` each)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @contextmanager
    def _volume(self, volume_id: str) -> Iterator[int]:
        """The volume's directory, opened without following anything."""
        flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.root / volume_id, flags)
        except FileNotFoundError as e:
            raise VolumePathError(Problem.NOT_FOUND, f"volume '{volume_id}' has no files") from e
        with _fd(fd):
            yield fd

    @contextmanager
    def _parent(self, volume: int, rel: str) -> Iterator[tuple[int, str]]:
        """The directory holding `rel` and its last name; `rel` must not be the root."""
        if not rel:
            raise VolumePathError(Problem.REFUSED, "the volume's root cannot be changed")
        head, _, name = rel.rpartition("/")
        try:
            fd = open_beneath(volume, head, os.O_PATH | os.O_DIRECTORY)
        except OSError as e:
            raise _failure(e, head) from e
        with _fd(fd):
            yield fd, name

    def _stat_in(self, dir_fd: int, name: str, rel: str) -> Entry:
        try:
            return entry_at(dir_fd, name, _shown(rel))
        except OSError as e:
            raise _failure(e, rel) from e

    def stat(self, volume_id: str, path: str) -> Entry:
        rel = relative(path)
        if not rel:
            with _fd(os.open(self.root, os.O_PATH | os.O_CLOEXEC)) as volumes:
                return replace(self._stat_in(volumes, volume_id, ""), name="/")
        with self._volume(volume_id) as volume, self._parent(volume, rel) as (parent, name):
            return self._stat_in(parent, name, rel)

    def listing(self, volume_id: str, path: str, depth: int) -> list[Entry]:
        """Entries under the directory `path`, `depth` levels deep, at most `MAX_LISTING`."""
        rel = relative(path)
        found: list[Entry] = []
        with self._volume(volume_id) as volume:
            try:
                fd = open_beneath(volume, rel, os.O_RDONLY | os.O_DIRECTORY)
            except OSError as e:
                raise _failure(e, rel) from e
            with _fd(fd):
                self._walk(fd, rel, depth, found)
        return found

    def _walk(self, dir_fd: int, rel: str, depth: int, found: list[Entry]) -> None:
        for name in sorted(os.listdir(dir_fd)):
            if len(found) >= MAX_LISTING:
                raise VolumePathError(
                    Problem.REFUSED, f"more than {MAX_LISTING} entries: list less deep"
                )
            child = f"{rel}/{name}" if rel else name
            try:
                entry = entry_at(dir_fd, name, _shown(child))
            except FileNotFoundError:
                continue  # removed while listed
            found.append(entry)
            if depth > 1 and entry.type is EntryType.DIRECTORY and entry.served:
                try:
                    fd = open_beneath(dir_fd, name, os.O_RDONLY | os.O_DIRECTORY)
                except OSError:
                    continue  # replaced while listed: listed as it was
                with _fd(fd):
                    self._walk(fd, child, depth - 1, found)

    def open_read(self, volume_id: str, path: str) -> tuple[int, int]:
        """An open descriptor of the regular file `path` and its size; the caller closes it."""
        rel = relative(path)
        with self._volume(volume_id) as volume, self._parent(volume, rel) as (parent, name):
            entry = self._stat_in(parent, name, rel)
            if entry.type is EntryType.DIRECTORY:
                raise VolumePathError(Problem.REFUSED, f"path '{entry.path}' is a directory")
            if not entry.served:
                raise _refusal(entry)
            try:
                # O_PATH first: nothing is opened for reading until the type is checked again on
                # the very file (a FIFO or device swapped in since the stat is never opened).
                pinned = open_beneath(parent, name, os.O_PATH)
            except OSError as e:
                raise _failure(e, rel) from e
            with _fd(pinned):
                st = os.fstat(pinned)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
                    raise VolumePathError(Problem.REFUSED, f"path '{entry.path}' changed")
                return os.open(f"/proc/self/fd/{pinned}", os.O_RDONLY | os.O_CLOEXEC), st.st_size

    def begin_write(self, volume_id: str, path: str, owner: Owner, parents: bool) -> Upload:
        """A new file beside `path`, to be renamed over it by `Upload.commit`. With `parents`,
        missing directories on the way are made first."""
        rel = relative(path)
        head, _, _ = rel.rpartition("/")
        if parents and head:
            self.make_dir(volume_id, head, Owner(), parents=True)
        with self._volume(volume_id) as volume, self._parent(volume, rel) as (parent, name):
            try:
                existing: Entry | None = entry_at(parent, name, _shown(rel))
            except FileNotFoundError:
                existing = None
            except OSError as e:  # a name over NAME_MAX, say
                raise _failure(e, rel) from e
            if existing is not None and existing.type is EntryType.DIRECTORY:
                raise VolumePathError(Problem.CONFLICT, f"path '{existing.path}' is a directory")
            if existing is not None and not existing.served:
                raise _refusal(existing)
            dir_fd = os.dup(parent)
        return Upload(dir_fd, name, rel, owner)

    def make_dir(self, volume_id: str, path: str, owner: Owner, parents: bool) -> Entry:
        """Raises `VolumePathError`: conflict when it exists (unless `parents`), not found when
        its parent does not (unless `parents`)."""
        rel = relative(path)
        if not rel:
            raise VolumePathError(Problem.CONFLICT, "the volume's root already exists")
        parts = rel.split("/")
        with self._volume(volume_id) as volume:
            for depth in range(1 if parents else len(parts), len(parts)):
                self._make_one(volume, "/".join(parts[:depth]), Owner(), exist_ok=True)
            return self._make_one(volume, rel, owner, exist_ok=parents)

    def _make_one(self, volume: int, rel: str, owner: Owner, exist_ok: bool) -> Entry:
        with self._parent(volume, rel) as (parent, name):
            try:
                os.mkdir(name, _DIR_MODE, dir_fd=parent)
            except FileExistsError:
                entry = self._stat_in(parent, name, rel)
                if not entry.served:
                    raise _refusal(entry) from None
                if not exist_ok or entry.type is not EntryType.DIRECTORY:
                    raise VolumePathError(
                        Problem.CONFLICT, f"path '{entry.path}' already exists"
                    ) from None
                return entry
            except OSError as e:
                raise _failure(e, rel) from e
            try:
                made = open_beneath(parent, name, os.O_RDONLY | os.O_DIRECTORY)
            except OSError as e:
                raise _failure(e, rel) from e
            with _fd(made):
                os.fchmod(made, _DIR_MODE)  # whatever the server's umask
                set_mapped(made, stat.S_IFDIR, owner)
            return self._stat_in(parent, name, rel)

    def remove(self, volume_id: str, path: str) -> None:
        """Removes a file or a whole directory; nothing is followed on the way down."""
        rel = relative(path)
        with self._volume(volume_id) as volume, self._parent(volume, rel) as (parent, name):
            entry = self._stat_in(parent, name, rel)
            try:
                if entry.type is EntryType.DIRECTORY and entry.served:
                    # With a directory descriptor, rmtree opens each level itself and never
                    # follows a symlink (its `_rmtree_safe_fd`).
                    shutil.rmtree(name, dir_fd=parent)
                else:
                    os.unlink(name, dir_fd=parent)
            except OSError as e:
                raise _failure(e, rel) from e

    def set_owner(self, volume_id: str, path: str, owner: Owner) -> Entry:
        """Changes the owner and mode guests see, on a served file or directory."""
        rel = relative(path)
        with self._volume(volume_id) as volume:
            if not rel:
                raise VolumePathError(Problem.REFUSED, "the volume's root cannot be changed")
            with self._parent(volume, rel) as (parent, name):
                entry = self._stat_in(parent, name, rel)
                if not entry.served:
                    raise _refusal(entry)
                kind = stat.S_IFDIR if entry.type is EntryType.DIRECTORY else stat.S_IFREG
                try:
                    pinned = open_beneath(parent, name, os.O_PATH)
                except OSError as e:
                    raise _failure(e, rel) from e
                with _fd(pinned):
                    if stat.S_IFMT(os.fstat(pinned).st_mode) != kind:
                        raise VolumePathError(Problem.REFUSED, f"path '{entry.path}' changed")
                    set_mapped(pinned, kind, owner)
                return self._stat_in(parent, name, rel)


class Upload:
    """A file being written beside its target: `write`, then `commit` or `abort`."""

    def __init__(self, dir_fd: int, name: str, rel: str, owner: Owner) -> None:
        self.dir_fd = dir_fd
        self.name = name
        self.rel = rel
        self.temp = f".{name[:200]}{_UPLOAD_MARK}{secrets.token_hex(6)}"
        self.size = 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self.fd = os.open(self.temp, flags, _FILE_MODE, dir_fd=dir_fd)
        except OSError as e:
            os.close(dir_fd)
            raise _failure(e, rel) from e
        os.fchmod(self.fd, _FILE_MODE)
        set_mapped(self.fd, stat.S_IFREG, owner)

    def write(self, chunk: bytes) -> None:
        try:
            view = memoryview(chunk)
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as e:
            raise _failure(e, self.rel) from e
        self.size += len(chunk)

    def commit(self) -> Entry:
        """Puts the new file in place of the target; the upload is over either way."""
        try:
            os.close(self.fd)
            self.fd = -1
            os.rename(self.temp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            return entry_at(self.dir_fd, self.name, _shown(self.rel))
        except OSError as e:
            raise _failure(e, self.rel) from e
        finally:
            self.abort()

    def abort(self) -> None:
        """Removes the new file unless committed; idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.dir_fd >= 0:
            with suppress(FileNotFoundError):  # renamed into place
                os.unlink(self.temp, dir_fd=self.dir_fd)
            os.close(self.dir_fd)
            self.dir_fd = -1
