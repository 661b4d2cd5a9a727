"""Where the test suites share guest builds (kernel, initramfs, base rootfs, envd bundle): one
cache for every suite, so a run builds each artifact once. `AENV_GUEST_CACHE` and
`AENV_DEBIAN_MIRROR` point them elsewhere (the server reads the same names through its
configuration)."""

from __future__ import annotations

import os
from pathlib import Path

from aenv.config import DEFAULT_MIRROR
from aenv.envd_bundle import build_bundle
from aenv.orchestrator.images import envd_bundle_dir

PROJECT = Path(__file__).resolve().parents[2]
GUEST_CACHE = Path(os.environ.get("AENV_GUEST_CACHE", str(PROJECT / "build" / "guest-cache")))
MIRROR = os.environ.get("AENV_DEBIAN_MIRROR", DEFAULT_MIRROR)


def envd_bundle() -> Path:
    """The envd bundle's directory, where the test servers build theirs (`envd_bundle_dir`):
    built on first use, then shared; concurrent builders wait."""
    return build_bundle(envd_bundle_dir(GUEST_CACHE)).parent
