"""A directory's listing as the files pages show it, a sandbox's (`files.py`) and a volume's
(`volume_files.py`): the path asked for, checked and normalized; its entries, directories
first; and the values `_listing.html` reads."""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from aenv.api.errors import APIError


@dataclass(frozen=True)
class Entry:
    name: str
    path: str
    dir: bool
    size: int


def absolute(given: str, where: str) -> str:
    """`given` normalized; a relative path is refused (`where`: "the sandbox", "the volume")."""
    if not given.startswith("/"):
        raise APIError(400, f"path: an absolute path in {where}")
    return posixpath.normpath(given)


def listing(path: str, entries: Iterable[Entry], base: str) -> dict[str, Any]:
    """What `_listing.html` shows of directory `path`; `base` is the page's own URL, which
    serves `?path=` and `/download`."""
    return {
        "path": path,
        "parent": posixpath.dirname(path) if path != "/" else None,
        "entries": sorted(entries, key=lambda e: (not e.dir, e.name)),
        "base": base,
    }
