"""Guest console files kept bounded.

A VMM appends what its guest writes to the serial console to a file (opened to append: every
write lands at the file's current end), and a guest can write without pause (`yes >
/dev/ttyS0`: ~11 MiB a minute). `cap` is run on every live VM's console file every few seconds:
past `limit` bytes the file's content is copied to `<name>.old.log` (replacing the previous
one) and the file is truncated, so each VM keeps at most about twice `limit` plus what its
guest writes between two runs. Bytes the guest writes between the copy and the truncation are
lost: a console is a diagnostic, not a record.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# Bytes a console file may reach before its content moves to the `.old.log` file.
LIMIT = 4 << 20
# How often the live VMs' console files are checked, in seconds.
INTERVAL = 5.0


def old_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}.old{path.suffix}")


def cap(path: Path, limit: int = LIMIT) -> bool:
    """Move `path`'s content aside when it exceeds `limit` bytes; True when it did. Blocking:
    run it in a thread."""
    try:
        if path.stat().st_size <= limit:
            return False
        old = old_path(path)
        partial = old.with_name(f".{old.name}.partial")
        shutil.copyfile(path, partial)
        os.replace(partial, old)
        os.truncate(path, 0)
    except FileNotFoundError:
        return False  # its sandbox went away meanwhile
    return True
