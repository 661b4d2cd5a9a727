"""Files replaced whole: a reader (or a restart after a crash) sees the old content or the new,
never a half-written file."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_text(path: Path, text: str, mode: int = 0o600) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`. Each write
    has its own temporary name: two writers of one file (a thread and the event loop) must not
    rename each other's. The file is 0600 by default: what a node writes is root's alone
    (see storage/private.py); a guest's system files are readable by all."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
