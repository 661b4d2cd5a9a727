"""`open_beneath` on a real directory: the kernel refuses every way out of it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from aenv.storage.beneath import open_beneath


def test_nothing_outside_and_no_symlink_is_opened(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "dir").mkdir(parents=True)
    (root / "dir" / "file").write_text("inside")
    (tmp_path / "outside").write_text("outside")
    (root / "up").symlink_to("..")
    (root / "inner").symlink_to("dir")
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        fd = open_beneath(root_fd, "dir/file", os.O_RDONLY)
        assert os.read(fd, 100) == b"inside"
        os.close(fd)
        for path, code in [
            ("../outside", errno.EXDEV),
            (str(tmp_path / "outside"), errno.EXDEV),
            ("dir/../../outside", errno.EXDEV),
            ("up/outside", errno.ELOOP),
            ("inner/file", errno.ELOOP),  # even a symlink that stays inside
            ("inner", errno.ELOOP),
            ("/proc/self/root/etc/hostname", errno.EXDEV),
        ]:
            with pytest.raises(OSError) as caught:
                open_beneath(root_fd, path, os.O_RDONLY)
            assert caught.value.errno == code, path
    finally:
        os.close(root_fd)
