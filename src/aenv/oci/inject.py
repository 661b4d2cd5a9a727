"""What an image's tree needs to boot as a guest root under our init (aenv.guest.init_script):
mount points it mounts on (/proc /sys /dev /run /tmp, /opt/aenv for the envd drive), the
default user `user` (uid 1000), and the /etc files stage 1 and envd read. The image's own files
win wherever they exist; only what is missing is added."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path, PurePosixPath

from aenv.guest.rootfs import UID, USER
from aenv.oci.unpack import resolve_in_root

HOME = f"/home/{USER}"
HOSTNAME = "sandbox"
_DIRS = {"proc": 0o555, "sys": 0o555, "dev": 0o755, "run": 0o755, "tmp": 0o1777, "root": 0o700}


def prepare_guest_tree(root: Path) -> None:
    """Add the mount points, user `user` and /etc basics to an unpacked image (runs as root,
    in a thread: it is all small file edits)."""
    root.chmod(0o755)
    for name, mode in _DIRS.items():
        _ensure_dir(root, name, mode)
    _ensure_dir(root, "opt/aenv", 0o755)  # the envd bundle drive is mounted here
    etc = _ensure_dir(root, "etc", 0o755)
    shell = "/bin/bash" if _exists(root, "bin/bash") or _exists(root, "usr/bin/bash") else "/bin/sh"
    _add_line(root, "etc/passwd", "root", "root:x:0:0:root:/root:/bin/sh", 0o644)
    _add_line(root, "etc/passwd", USER, f"{USER}:x:{UID}:{UID}::{HOME}:{shell}", 0o644)
    _add_line(root, "etc/group", "root", "root:x:0:", 0o644)
    _add_line(root, "etc/group", USER, f"{USER}:x:{UID}:", 0o644)
    if _exists(root, "etc/shadow"):
        # Locked password: `user` is reached through envd (and sudo, below), never by password.
        days = int(time.time() // 86400)
        _add_line(root, "etc/shadow", USER, f"{USER}:!:{days}:0:99999:7:::", 0o640)
    if (etc / "sudoers.d").is_dir() and not (etc / "sudoers.d" / USER).exists():
        sudoers = etc / "sudoers.d" / USER
        sudoers.write_text(f"{USER} ALL=(ALL) NOPASSWD:ALL\n")
        sudoers.chmod(0o440)
    _make_home(root)
    _write_if_missing(root, "etc/hostname", f"{HOSTNAME}\n")
    _write_if_missing(root, "etc/hosts", f"127.0.0.1 localhost {HOSTNAME}\n::1 localhost\n")
    # Stage 1 writes the sandbox's resolver here at boot; an empty file until then.
    _write_if_missing(root, "etc/resolv.conf", "")


def _inside(root: Path, rel: str) -> Path:
    """`rel` in the tree with every symlink resolved inside it (an image's /etc may be a link)."""
    return resolve_in_root(root, PurePosixPath(rel))


def _exists(root: Path, rel: str) -> bool:
    return _inside(root, rel).exists()


def _ensure_dir(root: Path, rel: str, mode: int) -> Path:
    path = _inside(root, rel)
    if not path.is_dir():
        if path.exists():
            path.unlink()
        path.mkdir(parents=True)
        path.chmod(mode)
    return path


def _add_line(root: Path, rel: str, name: str, line: str, mode: int) -> None:
    """Append `line` unless the colon-separated file already has an entry `name`."""
    path = _inside(root, rel)
    text = path.read_text() if path.exists() else ""
    if any(entry.split(":", 1)[0] == name for entry in text.splitlines()):
        return
    if text and not text.endswith("\n"):
        text += "\n"
    new = not path.exists()
    path.write_text(f"{text}{line}\n")
    if new:
        path.chmod(mode)


def _write_if_missing(root: Path, rel: str, text: str) -> None:
    # A dangling symlink counts as present: it is the image's choice (stage 1 replaces one).
    parent, name = rel.rsplit("/", 1)
    path = _inside(root, parent) / name
    if not os.path.lexists(path):
        path.write_text(text)
        path.chmod(0o644)


def _make_home(root: Path) -> None:
    home = _inside(root, HOME.lstrip("/"))
    if home.exists():
        return
    skel = _inside(root, "etc/skel")
    if skel.is_dir():
        shutil.copytree(skel, home, symlinks=True)
    else:
        home.mkdir(parents=True)
    home.chmod(0o750)
    for dirpath, dirnames, filenames in os.walk(home):
        for name in (dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)):
            os.chown(name, UID, UID, follow_symlinks=False)
