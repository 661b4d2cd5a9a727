"""Applying image layers, bottom first, to a directory: the union the image describes.

Each layer is a tar (plain, gzip or zstd). Whiteouts `.wh.<name>` delete a lower layer's entry,
`.wh..wh..opq` empties a directory of lower layers' entries. Ownership (numeric), modes, times,
xattrs, hardlinks, symlinks and device nodes are kept (device nodes and privileged xattrs only
as root). Paths never leave the root: names with `..` are refused, absolute names are taken
relative to the root, and symlinks met on the way are resolved as if the root were `/` (a link
to `/etc` inside the image means the image's /etc), like the container runtimes do.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import BinaryIO

import zstandard

from aenv.oci.blobs import DigestMismatchError
from aenv.oci.errors import ImageError

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
_MAX_LINKS = 40  # symlinks followed while resolving one path, as Linux's ELOOP limit


class UnsafeLayerError(ImageError):
    """A layer entry tries to reach outside the root, or cannot be applied safely."""


def apply_layer(root: Path, blob: Path, diff_id: str | None = None) -> None:
    """Apply one layer blob on top of `root`. Compression (none, gzip, zstd) is detected from
    the bytes rather than the media type: Docker and OCI name the same formats differently.
    `diff_id`, the image config's digest of the uncompressed tar, is checked when given (after
    the fact: the blob's own digest was verified when it was downloaded)."""
    with open(blob, "rb") as raw, _decompressed(raw) as stream:
        hashed = _Hashing(stream)
        with tarfile.open(fileobj=hashed, mode="r|") as tar:
            _apply(root, tar)
        while hashed.read(1 << 20):  # tar's end-of-archive padding counts too
            pass
    actual = f"sha256:{hashed.hasher.hexdigest()}"
    if diff_id is not None and diff_id != actual:
        raise DigestMismatchError(f"layer {blob.name} (uncompressed)", diff_id, actual)


class _Hashing(io.BufferedIOBase):
    """A reader that hashes what is read through it (tar's stream mode only calls read)."""

    def __init__(self, inner: io.BufferedIOBase | BinaryIO) -> None:
        super().__init__()
        self.inner = inner
        self.hasher = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        data = self.inner.read(-1 if size is None else size)
        self.hasher.update(data)
        return data


@contextmanager
def _decompressed(raw: BinaryIO) -> Iterator[io.BufferedIOBase | BinaryIO]:
    head = raw.read(4)
    raw.seek(0)
    if head[:2] == b"\x1f\x8b":
        with gzip.GzipFile(fileobj=raw) as gz:
            yield gz
    elif head == b"\x28\xb5\x2f\xfd":
        with zstandard.ZstdDecompressor().stream_reader(raw) as zst:
            yield zst
    else:
        yield raw


def _apply(root: Path, tar: tarfile.TarFile) -> None:
    added: set[PurePosixPath] = set()  # this layer's own entries survive its opaque markers
    dirs: list[tuple[Path, tarfile.TarInfo]] = []
    for member in tar:
        name = _clean(member.name)
        if name is None:
            continue  # the root itself
        parent = resolve_in_root(root, name.parent)
        base = name.name
        if base == OPAQUE:
            _make_opaque(parent, name.parent, added)
            continue
        if base.startswith(WHITEOUT):
            hidden = base[len(WHITEOUT) :]
            if hidden in ("", ".", ".."):
                raise UnsafeLayerError(f"{member.name!r}: whiteout of {hidden!r}")
            _remove(parent / hidden)
            continue
        added.add(name)
        target = parent / base
        if member.isdir():
            if target.is_symlink() or (target.exists() and not target.is_dir()):
                _remove(target)
            target.mkdir(parents=True, exist_ok=True)
            dirs.append((target, member))  # mode and mtime after its contents are written
            continue
        _remove(target)
        parent.mkdir(parents=True, exist_ok=True)
        if member.isreg():
            _write_file(target, tar, member)
        elif member.issym():
            os.symlink(member.linkname, target)
        elif member.islnk():
            link = _clean(member.linkname)
            if link is None:
                raise UnsafeLayerError(f"{member.name}: hardlink to the root")
            source = resolve_in_root(root, link.parent) / link.name
            if not os.path.lexists(source) or (source.is_dir() and not source.is_symlink()):
                raise UnsafeLayerError(f"{member.name}: hardlink to missing {member.linkname}")
            os.link(source, target, follow_symlinks=False)
            continue  # a hardlink shares its target's inode: metadata is the target's
        elif member.ischr() or member.isblk() or member.isfifo():
            if not _make_node(target, member):
                continue
        else:
            continue  # GNU sparse or unknown types: nothing portable to create
        _set_metadata(target, member)
    for path, member in reversed(dirs):
        if path.is_dir() and not path.is_symlink():  # not replaced later in the layer
            _set_metadata(path, member)


def _clean(name: str) -> PurePosixPath | None:
    """The member's path relative to the root; `..` anywhere is refused outright."""
    parts = [p for p in PurePosixPath("/", name).parts[1:] if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeLayerError(f"{name!r}: path with '..'")
    return PurePosixPath(*parts) if parts else None


def resolve_in_root(root: Path, rel: PurePosixPath) -> Path:
    """The real directory for `rel`, following symlinks inside the root only (chroot-like)."""
    todo = list(rel.parts)
    current: list[str] = []
    hops = 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if current:
                current.pop()  # `..` at the root stays at the root
            continue
        path = root.joinpath(*current, part)
        if path.is_symlink():
            hops += 1
            if hops > _MAX_LINKS:
                raise UnsafeLayerError(f"{rel}: too many levels of symbolic links")
            link = os.readlink(path)
            if link.startswith("/"):
                current = []
            todo = [p for p in link.split("/") if p] + todo
            continue
        current.append(part)
    return root.joinpath(*current)


def _make_opaque(directory: Path, name: PurePosixPath, added: set[PurePosixPath]) -> None:
    if not directory.is_dir():
        return
    for child in directory.iterdir():
        if name / child.name not in added:
            _remove(child)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _write_file(target: Path, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
    source = tar.extractfile(member)
    assert source is not None  # regular members always have data
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    with source, os.fdopen(os.open(target, flags, 0o600), "wb") as out:
        shutil.copyfileobj(source, out, 1 << 20)


def _make_node(target: Path, member: tarfile.TarInfo) -> bool:
    kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK if member.isblk() else stat.S_IFIFO
    try:
        os.mknod(target, kind | 0o600, os.makedev(member.devmajor, member.devminor))
    except PermissionError:
        return False  # not root: the guest's devtmpfs provides devices anyway
    return True


def _set_metadata(path: Path, member: tarfile.TarInfo) -> None:
    link = member.issym()
    if os.geteuid() == 0:
        os.chown(path, member.uid, member.gid, follow_symlinks=False)
    for key, value in member.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            _set_xattr(path, key[len("SCHILY.xattr.") :], value)
    if not link:
        # After chown, which clears setuid/setgid bits.
        os.chmod(path, member.mode & 0o7777)
    os.utime(path, (member.mtime, member.mtime), follow_symlinks=False)


def _set_xattr(path: Path, key: str, value: str) -> None:
    # tarfile decodes PAX values as UTF-8 with surrogateescape: this gives back the raw bytes.
    raw = value.encode("utf-8", "surrogateescape")
    try:
        os.setxattr(path, key, raw, follow_symlinks=False)
    except OSError as e:
        # Symlinks cannot carry user.* xattrs, and non-root cannot set trusted.*/security.*.
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EACCES):
            raise
