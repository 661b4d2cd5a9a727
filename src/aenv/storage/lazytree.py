"""Files of a restored manifest served in place while they arrive: a VMM opens and maps them at
their own paths at once, each read filling its chunks from the repository's sources, and the
rest is fetched in the background until they are ordinary local files.

A restore that lacks a saved state's large, sparsely read files (guest memory, read-only drive
images) pulls the rest whole (`Repository.get_tree(defer=...)`) and serves each of those
through a `LazyFile` (`repository/lazy.py`) as the one file of a FUSE mount of its own
(`fusefile.py`), bind-mounted onto the path the saved state names: `snapshot.json` stays as a
whole pull writes it, and a VMM's jail bind-mounts that path as any other. Beside it:

    <dir>/memory             the bind mount of the FUSE file while it is lazy, over the file
    <dir>/.memory.lazy       the local sparse file the chunks are written into (its other name)
    <dir>/.memory.mnt/       the FUSE mount itself

Under the bind mount, the path is another name of the local file. Once every file is whole it
is uncovered (`_place_file`): the bind mount and the FUSE mount are detached (who opened or
mapped the file keeps reading it: the FUSE server goes on serving, now from the local file),
so the path is the local file, whole, with no moment in between. From then on the directory
is an ordinary restored copy (a pause of the VM names the memory file as its base, as after a
whole pull). `close` ends the FUSE servers once no VMM uses the files; a copy that was never
completed is removed then: an incomplete copy is no copy.

A chunk no source gives within the `LazyFile`'s patience fails the read that needed it (the
VMM gets EIO, or SIGBUS for a mapped page: never zeros) and the background fetch; the owner is
told (`on_failure`). After a crash of the node the mounts stay behind, dead (their server is
gone): `sweep` detaches those under a home at the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from aenv.storage.fusefile import MNT_DETACH, SOURCE, FuseFile
from aenv.storage.repository.lazy import BACKGROUND, LazyFile
from aenv.storage.repository.manifest import Manifest
from aenv.storage.repository.repository import Repository

log = logging.getLogger("aenv.lazy")

_MS_BIND = 4096


def available() -> bool:
    """Whether this process can serve files lazily (FUSE mounts need root and /dev/fuse)."""
    return os.geteuid() == 0 and os.path.exists("/dev/fuse")


@dataclass
class _Served:
    target: Path  # the path the saved state names
    lazy: LazyFile
    fuse: FuseFile
    mode: int
    placed: bool = False


class LazyTree:
    def __init__(self, dest: Path, served: list[_Served]) -> None:
        self.dest = dest
        self._served = served
        self.error: BaseException | None = None
        self.on_failure: Callable[[BaseException], None] = lambda _: None
        self._done: asyncio.Task[None] | None = None

    @classmethod
    async def serve(
        cls,
        repository: Repository,
        manifest: Manifest,
        dest: Path,
        paths: Collection[str],
        order: Mapping[str, Sequence[int]] | None = None,
        prefetch: int = BACKGROUND,
    ) -> LazyTree:
        """Serve `paths` of `manifest` at their places in `dest` (a `get_tree` of it that
        deferred them), then fetch the rest of them, the chunks of `order` (by path) first,
        `prefetch` at a time (`LazyFile.complete`). Raises `OSError` when a mount fails
        (nothing of it left)."""
        loop = asyncio.get_running_loop()
        entries = {f.path: f for f in manifest.files}
        tree = cls(dest, [])
        try:
            for path in paths:
                entry = entries[path]
                target = dest / path
                lazy = LazyFile(repository, manifest, entry, _beside(target, "lazy"))
                # Under the mount, the path names the local file itself: once detached, the
                # path is the local file at once, with no moment of another file there.
                await asyncio.to_thread(_link_over, lazy.path, target)
                fuse = FuseFile(lazy, target.name)
                tree._served.append(_Served(target, lazy, fuse, entry.mode))
                mountpoint = _beside(target, "mnt")
                await asyncio.to_thread(mountpoint.mkdir)
                await asyncio.to_thread(fuse.mount, mountpoint, loop)
                await asyncio.to_thread(_bind, fuse.path, target)
        except BaseException:
            await tree.close()
            raise
        tree._done = asyncio.create_task(tree._complete(order or {}, prefetch))
        return tree

    @property
    def touched(self) -> dict[str, list[int]]:
        """The chunks reads needed, by path, in the order they first needed them."""
        return {str(s.target.relative_to(self.dest)): list(s.lazy.touched) for s in self._served}

    @property
    def waited(self) -> int:
        """How many chunks reads found missing and waited for (two readers of one: two)."""
        return sum(s.lazy.waited for s in self._served)

    @property
    def whole(self) -> bool:
        return all(s.placed for s in self._served)

    async def wait_whole(self) -> None:
        """Until every file is local and in place; raises what stopped that (`ChunkError`)."""
        assert self._done is not None
        await asyncio.shield(self._done)

    async def _complete(self, order: Mapping[str, Sequence[int]], prefetch: int) -> None:
        try:
            await asyncio.gather(
                *(
                    s.lazy.complete(order.get(str(s.target.relative_to(self.dest)), ()), prefetch)
                    for s in self._served
                )
            )
            for served in self._served:
                await asyncio.to_thread(_place_file, served)
                served.lazy.path = served.target  # the same inode: reads go on from there
                await asyncio.to_thread(_beside(served.target, "lazy").unlink)
                served.placed = True
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.error("lazily served files of %s: %s", self.dest, error)
            self.error = error
            self.on_failure(error)
            raise

    async def close(self) -> None:
        """Stop serving (call it once no VMM uses the files): the background fetch stops, the
        mounts go, and a copy not whole yet is removed."""
        if self._done is not None:
            self._done.cancel()
            with contextlib.suppress(BaseException):
                await self._done
        for served in self._served:
            served.lazy.close()
            if not served.placed:
                await asyncio.to_thread(_detach, served.target)
            await asyncio.to_thread(served.fuse.unmount)
            with contextlib.suppress(OSError):
                await asyncio.to_thread(_beside(served.target, "mnt").rmdir)
        if not self.whole:
            await asyncio.to_thread(shutil.rmtree, self.dest, True)


def _beside(target: Path, role: str) -> Path:
    return target.with_name(f".{target.name}.{role}")


_libc = ctypes.CDLL(None, use_errno=True)


def _bind(source: Path, target: Path) -> None:
    if _libc.mount(bytes(source), bytes(target), None, _MS_BIND, None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"bind-mounting {source} on {target}: {os.strerror(code)}")


def _detach(target: Path) -> None:
    if _libc.umount2(bytes(target), MNT_DETACH) != 0:
        log.warning("unmounting %s: %s", target, os.strerror(ctypes.get_errno()))


def _link_over(source: Path, target: Path) -> None:
    """`target` another name of `source`, in one rename. Blocking."""
    staged = _beside(target, "new")
    os.link(source, staged)
    os.rename(staged, target)


def _place_file(served: _Served) -> None:
    """Uncover a whole local file at its path (see the module docstring). Blocking."""
    fd = os.open(_beside(served.target, "lazy"), os.O_RDONLY)
    try:
        os.fsync(fd)
        os.fchmod(fd, served.mode)
    finally:
        os.close(fd)
    _detach(served.target)
    served.fuse.detach()
    _beside(served.target, "mnt").rmdir()


def sweep(home: Path) -> list[Path]:
    """Detach the lazy mounts under `home` a previous process left (their server is gone);
    returns their mount points. Blocking."""
    found: list[Path] = []
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields, _, rest = line.partition(" - ")
            source = rest.split()[1] if len(rest.split()) > 1 else ""
            where = Path(_unescape(fields.split()[4]))
            if source == SOURCE and where.is_relative_to(home):
                found.append(where)
    for where in sorted(found, key=lambda p: len(p.parts), reverse=True):
        _detach(where)
    return found


def _unescape(field: str) -> str:
    """A path as mountinfo writes it: space, tab, newline and backslash as octal escapes."""
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field
