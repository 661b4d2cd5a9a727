"""Which sandbox the kernels run in, and fresh randomness when that changes.

A fork or a sandbox started from a snapshot is a clone of one running server and its kernels:
their variables are meant to carry over, but their random generators would then repeat each
other's numbers. The node gives every sandbox its own hostname (envd's `/init` sets it after
each restore, with fresh entropy for the guest's own RNG), so a context whose kernel last ran
under another hostname is a clone: before its next execution, its `random` generator and
numpy's global one (when imported) are reseeded from the guest RNG. Pause and resume keep the
hostname, and so the generators' state.
"""

from __future__ import annotations

import os

# Leaves no names in the user's namespace.
RESEED_CODE = """(lambda os, sys: (
    sys.modules["random"].seed(os.urandom(32)) if "random" in sys.modules else None,
    sys.modules["numpy"].random.seed(int.from_bytes(os.urandom(4), "little"))
    if "numpy" in sys.modules else None,
))(__import__("os"), __import__("sys"))
"""


def current() -> str:
    """This sandbox's name (its hostname)."""
    return os.uname().nodename
