"""Files replaced whole: a reader (or a restart after a crash) sees the old content or the new,
never a half-written file."""

from __future__ import annotations

import os
from pathlib import Path


def write_text(path: Path, text: str) -> None:
    """Write `text` to a temporary name beside `path`, then rename it over `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
