"""Layers applied in order from a real registry: whiteouts, opaque directories, hardlinks,
symlinks, xattrs, ownership, modes and device nodes; hostile entries refused or contained."""

from __future__ import annotations

import os
import stat
import tarfile
from pathlib import Path

import pytest

from aenv.oci import UnsafeLayerError, pull
from aenv.oci.unpack import apply_layer
from tests.oci.images import Entry, Image, Publish, directory, entry, hardlink, symlink


async def unpacked(ref: str, tmp_path: Path) -> Path:
    image = await pull(ref, tmp_path / "oci")
    tree = tmp_path / "tree"
    tree.mkdir()
    for layer in image.layers:
        apply_layer(tree, image.layer_path(layer))
    return tree


async def test_layers_union(publish: Publish, tmp_path: Path) -> None:
    base = [
        directory("etc"),
        entry("etc/kept", b"kept\n"),
        entry("etc/removed", b"gone\n"),
        directory("data", mode=0o750, uid=1234, gid=2345),
        entry("data/lower-a", b"a"),
        directory("data/lower-dir"),
        entry("data/lower-dir/x", b"x"),
        entry("bin-tool", b"#!/bin/sh\n", mode=0o4755, uid=0, gid=50),
        entry("owned", b"o", uid=1234, gid=2345, mode=0o640),
        hardlink("kept-link", "etc/kept"),
        symlink("etc/alias", "kept"),
        entry("tagged", b"t", xattrs={"user.origin": "layer1", "trusted.raw": "\x00\x01"}),
        entry("dev/null", kind=tarfile.CHRTYPE, mode=0o666, dev=(1, 3)),
        entry("pipe", kind=tarfile.FIFOTYPE, mode=0o600),
        directory("replaced"),
        entry("replaced/inner", b"i"),
    ]
    middle = [
        entry("etc/.wh.removed"),
        entry("data/upper-b", b"b"),  # before the marker, in the same layer: it stays
        entry("data/.wh..wh..opq"),
        entry("data/upper-c", b"c"),
        entry("replaced", b"now a file\n"),  # a file over a lower directory
    ]
    top = [
        entry("etc/kept", b"new kept\n"),  # a new file: the lower hardlink keeps the old one
        hardlink("etc/kept-again", "etc/kept"),
        symlink("data/link", "/etc/kept"),
    ]
    tree = await unpacked(publish(Image([base, middle, top])), tmp_path)

    assert not (tree / "etc" / "removed").exists()
    assert sorted(os.listdir(tree / "data")) == ["link", "upper-b", "upper-c"]
    data = (tree / "data").stat()
    assert (data.st_uid, data.st_gid, stat.S_IMODE(data.st_mode)) == (1234, 2345, 0o750)
    assert (tree / "replaced").read_text() == "now a file\n"

    assert (tree / "etc" / "kept").read_text() == "new kept\n"
    assert (tree / "kept-link").read_text() == "kept\n"
    assert os.path.samefile(tree / "etc" / "kept", tree / "etc" / "kept-again")
    assert (tree / "etc" / "kept").stat().st_nlink == 2
    assert os.readlink(tree / "etc" / "alias") == "kept"
    assert os.readlink(tree / "data" / "link") == "/etc/kept"

    tool = (tree / "bin-tool").stat()
    assert (stat.S_IMODE(tool.st_mode), tool.st_gid) == (0o4755, 50)  # setuid survives chown
    owned = (tree / "owned").stat()
    assert (owned.st_uid, owned.st_gid, stat.S_IMODE(owned.st_mode)) == (1234, 2345, 0o640)
    assert owned.st_mtime == 1_700_000_000
    assert os.getxattr(tree / "tagged", "user.origin") == b"layer1"
    assert os.getxattr(tree / "tagged", "trusted.raw") == b"\x00\x01"
    null = (tree / "dev" / "null").stat()
    assert stat.S_ISCHR(null.st_mode) and null.st_rdev == os.makedev(1, 3)
    assert stat.S_ISFIFO((tree / "pipe").stat().st_mode)


@pytest.mark.parametrize(
    "hostile",
    [
        [entry("../escape", b"x")],
        [directory("etc"), entry("etc/../../escape", b"x")],
        [entry("passwd-link", kind=tarfile.LNKTYPE, link="../../etc/passwd")],
        [entry(".wh...", b"")],
    ],
    ids=["dotdot", "nested-dotdot", "hardlink-out", "whiteout-dotdot"],
)
async def test_traversal_is_refused(publish: Publish, tmp_path: Path, hostile: list[Entry]) -> None:
    ref = publish(Image([hostile]))
    with pytest.raises(UnsafeLayerError):
        await unpacked(ref, tmp_path)
    assert not (tmp_path / "escape").exists()


async def test_symlinks_and_absolute_names_stay_inside(publish: Publish, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    layer1 = [
        symlink("to-root", "/"),
        symlink("to-outside", str(outside)),
        symlink("up", "../../../.."),
        directory("etc"),
    ]
    layer2 = [
        entry("to-root/etc/via-root", b"1"),  # written through a link: lands in the image's /etc
        entry("to-outside/planted", b"2"),
        entry("up/etc/via-up", b"3"),
        entry("/abs-name", b"4"),
        hardlink("hard-through-link", "to-root/etc/via-root"),
    ]
    tree = await unpacked(publish(Image([layer1, layer2])), tmp_path)
    assert (tree / "etc" / "via-root").read_text() == "1"
    assert (tree / "etc" / "via-up").read_text() == "3"
    assert (tree / "abs-name").read_text() == "4"
    assert not (outside / "planted").exists()
    assert (tree / outside.relative_to("/") / "planted").read_text() == "2"
    assert os.path.samefile(tree / "hard-through-link", tree / "etc" / "via-root")
