"""Files replaced whole: a reader (or a restart after a crash) sees the old content or the new,
never a half-written file."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_text(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`. Each write
    has its own temporary name: two writers of one file (a thread and the event loop) must not
    rename each other's. The file is 0600 (mkstemp's mode): what a node writes is root's alone
    (see storage/private.py)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
