"""Where the test suites share guest builds (kernel, initramfs, base rootfs): one cache for every
suite, so a run builds each artifact once. `AENV_GUEST_CACHE` and `AENV_DEBIAN_MIRROR` point them
elsewhere (the server reads the same names through its configuration)."""

from __future__ import annotations

import os
from pathlib import Path

from aenv.config import DEFAULT_MIRROR

PROJECT = Path(__file__).resolve().parents[2]
GUEST_CACHE = Path(os.environ.get("AENV_GUEST_CACHE", str(PROJECT / "build" / "guest-cache")))
MIRROR = os.environ.get("AENV_DEBIAN_MIRROR", DEFAULT_MIRROR)
