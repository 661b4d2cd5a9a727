"""Guest-like root trees without Python, for running the envd bundle in a chroot.

`debian_minbase` debootstraps Debian's smallest variant (glibc, bash, no python3) once per set of
inputs into `build/test-rootfs/`; `busybox_root` makes a root holding only a static busybox (no
libc at all) in a directory the caller owns.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]
CACHE = PROJECT / "build" / "test-rootfs"
MIRROR = os.environ.get("AENV_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BUSYBOX = Path("/bin/busybox")
USER_UID = 1000


def debian_minbase(suite: str = "bookworm") -> Path:
    """A cached `debootstrap --variant=minbase` tree with `user` (uid 1000, home /home/user)."""
    # Bump "recipe" whenever the steps below change, so old trees are not reused.
    inputs = {"suite": suite, "variant": "minbase", "mirror": MIRROR, "recipe": 1}
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    tree = CACHE / f"debian-{suite}-{key}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / f"{tree.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if tree.exists():
            return tree
        # Built aside, then renamed into place: an interrupted run never leaves a tree that looks
        # complete.
        scratch = Path(tempfile.mkdtemp(prefix=f"{tree.name}.", dir=CACHE))
        try:
            part = scratch / "tree"
            subprocess.run(
                ["debootstrap", "--variant=minbase", suite, str(part), MIRROR],
                check=True,
                capture_output=True,
            )
            useradd = ["useradd", "-m", "-u", str(USER_UID), "-s", "/bin/bash", "user"]
            subprocess.run(["chroot", str(part), *useradd], check=True, capture_output=True)
            shutil.rmtree(part / "var" / "cache" / "apt" / "archives", ignore_errors=True)
            part.rename(tree)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return tree


def busybox_root(root: Path) -> Path:
    """Fill `root` with a static busybox and its applets, `root` and `user` accounts, and a
    `/bin/bash` that hands over to busybox's shell (envd starts commands with `bash -l -c`)."""
    for d in ("bin", "etc", "proc", "dev", "sys", "tmp", "home/user", "root"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in subprocess.run(
        [str(BUSYBOX), "--list"], check=True, capture_output=True, text=True
    ).stdout.split():
        if applet not in ("busybox", "bash"):
            (root / "bin" / applet).symlink_to("busybox")
    (root / "bin" / "bash").write_text('#!/bin/sh\nexec /bin/sh "$@"\n')
    (root / "bin" / "bash").chmod(0o755)
    (root / "etc" / "passwd").write_text(
        f"root:x:0:0:root:/root:/bin/sh\nuser:x:{USER_UID}:{USER_UID}::/home/user:/bin/bash\n"
    )
    (root / "etc" / "group").write_text(f"root:x:0:\nuser:x:{USER_UID}:\n")
    os.chown(root / "home" / "user", USER_UID, USER_UID)
    return root
