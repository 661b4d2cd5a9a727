"""A node's data is root's alone.

The data directory holds every sandbox's envd token and env vars (the catalog and its WAL,
`template.json`), guest memory and disks, and the API key; the node's tmpfs directory holds
guest memory. Their top directories are made 0700 at every start, whatever an older node or an
operator left: a local user who cannot enter them reaches nothing below, whatever the modes of
the files there. (A blanket umask or a chmod of every file would not do: template builds
unpack guest root filesystems below the data directory, whose modes are the guest's.) Files
that hold secrets are also created 0600 by their writers (the catalog, `atomic.write_text`,
state files, the API key).

Jailed VMMs, which run under another uid, are given their own files by the jail, not through
these directories' modes.
"""

from __future__ import annotations

import os
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def make_private(*directories: Path) -> None:
    """Create each of `directories` (and missing parents) if needed and make it 0700."""
    for directory in directories:
        directory.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        os.chmod(directory, DIR_MODE)


def private_file(path: Path) -> None:
    """Make `path` 0600, creating it empty if missing (for files other code then opens, such as
    SQLite's database, whose journal files take its mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
