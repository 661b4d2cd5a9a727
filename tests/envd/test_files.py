"""files.* through the sync SDK: read/write (text, bytes, streams, large, gzip, several files),
list, get_info, exists, make_dir, rename, remove, metadata, ownership."""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from e2b import (
    CommandExitException,
    FileType,
    InvalidArgumentException,
    NotFoundException,
    Sandbox,
)
from e2b.sandbox.filesystem.filesystem import WriteEntry

MIB = 1024 * 1024


def test_write_and_read_text(sandbox: Sandbox, workdir: str) -> None:
    info = sandbox.files.write(f"{workdir}/t.txt", "héllo\nwörld")
    assert (info.name, info.path, info.type) == ("t.txt", f"{workdir}/t.txt", FileType.FILE)
    assert sandbox.files.read(f"{workdir}/t.txt") == "héllo\nwörld"


def test_write_and_read_bytes(sandbox: Sandbox, workdir: str) -> None:
    data = bytes(range(256)) * 100
    sandbox.files.write(f"{workdir}/b.bin", data)
    assert sandbox.files.read(f"{workdir}/b.bin", format="bytes") == data


def test_overwrite_truncates(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/o.txt", "a long first version")
    sandbox.files.write(f"{workdir}/o.txt", "short")
    assert sandbox.files.read(f"{workdir}/o.txt") == "short"


def test_empty_file(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/empty", b"")
    assert sandbox.files.read(f"{workdir}/empty", format="bytes") == b""
    assert sandbox.files.get_info(f"{workdir}/empty").size == 0


def test_read_stream(sandbox: Sandbox, workdir: str) -> None:
    data = os.urandom(3 * MIB)
    sandbox.files.write(f"{workdir}/s.bin", data)
    chunks = list(sandbox.files.read(f"{workdir}/s.bin", format="stream"))
    assert b"".join(chunks) == data


def test_write_file_object_and_iterable(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/f.bin", io.BytesIO(b"from a file object"))
    assert sandbox.files.read(f"{workdir}/f.bin") == "from a file object"
    sandbox.files.write(f"{workdir}/i.bin", iter([b"from ", b"an ", b"iterable"]))
    assert sandbox.files.read(f"{workdir}/i.bin") == "from an iterable"


def test_write_octet_stream_explicitly(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/raw.txt", "raw body", use_octet_stream=True)
    assert sandbox.files.read(f"{workdir}/raw.txt") == "raw body"


def _pattern(size: int) -> Iterator[bytes]:
    block = hashlib.sha256(b"aenv").digest() * (MIB // 32)
    for _ in range(size // MIB):
        yield block


def test_large_file_streams_both_ways(sandbox: Sandbox, workdir: str, tmp_path: Path) -> None:
    size = 100 * MIB
    source = tmp_path / "big.bin"
    digest = hashlib.sha256()
    with source.open("wb") as f:
        for block in _pattern(size):
            f.write(block)
            digest.update(block)
    with source.open("rb") as f:
        info = sandbox.files.write(f"{workdir}/big.bin", f, request_timeout=300)
    assert info.path == f"{workdir}/big.bin"
    assert sandbox.files.get_info(f"{workdir}/big.bin").size == size
    check = sandbox.commands.run(f"sha256sum {workdir}/big.bin").stdout.split()[0]
    assert check == digest.hexdigest()

    received = hashlib.sha256()
    total = 0
    for chunk in sandbox.files.read(f"{workdir}/big.bin", format="stream", request_timeout=300):
        received.update(chunk)
        total += len(chunk)
    assert total == size
    assert received.hexdigest() == digest.hexdigest()


def test_write_files_several_paths_and_nested_dirs(sandbox: Sandbox, workdir: str) -> None:
    infos = sandbox.files.write_files(
        [
            WriteEntry(path=f"{workdir}/one.txt", data="1"),
            WriteEntry(path=f"{workdir}/deep/er/two.txt", data=b"2"),
            WriteEntry(path=f"{workdir}/deep/three.txt", data=io.BytesIO(b"3")),
        ]
    )
    assert sorted(i.path for i in infos) == sorted(
        [f"{workdir}/one.txt", f"{workdir}/deep/er/two.txt", f"{workdir}/deep/three.txt"]
    )
    assert sandbox.files.read(f"{workdir}/deep/er/two.txt") == "2"
    assert sandbox.files.read(f"{workdir}/deep/three.txt") == "3"
    deep = sandbox.files.get_info(f"{workdir}/deep/er")
    assert (deep.type, deep.owner, deep.group) == (FileType.DIR, "user", "user")


def test_write_creates_parents_owned_by_user(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/x/y/z.txt", "z")
    for path in (f"{workdir}/x", f"{workdir}/x/y", f"{workdir}/x/y/z.txt"):
        info = sandbox.files.get_info(path)
        assert (info.owner, info.group) == ("user", "user")
    assert sandbox.files.get_info(f"{workdir}/x").mode == 0o755


def test_relative_path_is_under_home(sandbox: Sandbox, workdir: str) -> None:
    relative = workdir.removeprefix("/home/user/") + "/rel.txt"
    info = sandbox.files.write(relative, "rel")
    assert info.path == f"{workdir}/rel.txt"
    assert sandbox.files.read(f"{workdir}/rel.txt") == "rel"
    assert sandbox.files.read(f"~/{relative}") == "rel"


def test_write_as_root_is_owned_by_root(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/root.txt", "r", user="root")
    info = sandbox.files.get_info(f"{workdir}/root.txt")
    assert (info.owner, info.group) == ("root", "root")
    sandbox.files.write("/root/aenv-test.txt", "root home", user="root")
    try:
        assert sandbox.files.read("~/aenv-test.txt", user="root") == "root home"
    finally:
        sandbox.files.remove("/root/aenv-test.txt", user="root")


def test_read_missing_file(sandbox: Sandbox, workdir: str) -> None:
    with pytest.raises(NotFoundException):
        sandbox.files.read(f"{workdir}/missing.txt")


def test_read_directory_is_invalid(sandbox: Sandbox, workdir: str) -> None:
    with pytest.raises(InvalidArgumentException):
        sandbox.files.read(workdir)


def test_write_onto_directory_is_invalid(sandbox: Sandbox, workdir: str) -> None:
    with pytest.raises(InvalidArgumentException):
        sandbox.files.write(workdir, "x")


def test_gzip_write_and_read(sandbox: Sandbox, workdir: str) -> None:
    data = b"compressible " * 10000
    sandbox.files.write(f"{workdir}/g.txt", data, gzip=True)
    assert sandbox.files.read(f"{workdir}/g.txt", format="bytes") == data
    assert sandbox.files.read(f"{workdir}/g.txt", format="bytes", gzip=True) == data
    assert b"".join(sandbox.files.read(f"{workdir}/g.txt", format="stream", gzip=True)) == data


def test_list_depth(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write_files(
        [
            WriteEntry(path=f"{workdir}/a.txt", data="a"),
            WriteEntry(path=f"{workdir}/d1/b.txt", data="b"),
            WriteEntry(path=f"{workdir}/d1/d2/c.txt", data="c"),
        ]
    )
    one = sandbox.files.list(workdir)
    assert sorted((e.name, e.type) for e in one) == [
        ("a.txt", FileType.FILE),
        ("d1", FileType.DIR),
    ]
    assert {e.path for e in one} == {f"{workdir}/a.txt", f"{workdir}/d1"}
    two = sandbox.files.list(workdir, depth=2)
    assert sorted(e.path for e in two) == sorted(
        [f"{workdir}/a.txt", f"{workdir}/d1", f"{workdir}/d1/b.txt", f"{workdir}/d1/d2"]
    )
    three = sandbox.files.list(workdir, depth=3)
    assert f"{workdir}/d1/d2/c.txt" in {e.path for e in three}


def test_list_missing_and_not_a_directory(sandbox: Sandbox, workdir: str) -> None:
    with pytest.raises(NotFoundException):
        sandbox.files.list(f"{workdir}/nope")
    sandbox.files.write(f"{workdir}/file", "f")
    with pytest.raises(InvalidArgumentException):
        sandbox.files.list(f"{workdir}/file")


def test_list_rejects_negative_depth(sandbox: Sandbox, workdir: str) -> None:
    with pytest.raises(InvalidArgumentException):
        sandbox.files.list(workdir, depth=0)


def test_get_info_of_file(sandbox: Sandbox, workdir: str) -> None:
    before = datetime.now(UTC) - timedelta(minutes=5)
    sandbox.files.write(f"{workdir}/info.txt", "12345")
    info = sandbox.files.get_info(f"{workdir}/info.txt")
    assert info.name == "info.txt"
    assert info.path == f"{workdir}/info.txt"
    assert info.type == FileType.FILE
    assert info.size == 5
    assert (info.owner, info.group) == ("user", "user")
    assert info.mode == 0o644
    assert info.permissions == "-rw-r--r--"
    assert info.symlink_target is None
    assert info.modified_time > before


def test_get_info_of_directory_and_permissions(sandbox: Sandbox, workdir: str) -> None:
    sandbox.commands.run(f"mkdir {workdir}/d && chmod 1750 {workdir}/d && chmod 600 {workdir}")
    try:
        info = sandbox.files.get_info(f"{workdir}/d")
        assert info.type == FileType.DIR
        assert info.mode == 0o750
        assert info.permissions == "dtrwxr-x---"
        assert sandbox.files.get_info(workdir).permissions == "drw-------"
    finally:
        sandbox.commands.run(f"chmod 755 {workdir}")


def test_get_info_of_symlink(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/target.txt", "t")
    sandbox.commands.run(f"ln -s target.txt {workdir}/link && ln -s /nowhere {workdir}/dangling")
    link = sandbox.files.get_info(f"{workdir}/link")
    assert link.type == FileType.SYMLINK
    assert link.symlink_target == f"{workdir}/target.txt"
    assert link.permissions == "Lrwxrwxrwx"
    assert link.mode == 0o644  # the target's
    assert link.name == "link"
    dangling = sandbox.files.get_info(f"{workdir}/dangling")
    assert dangling.type == FileType.SYMLINK
    listed = {e.name: e for e in sandbox.files.list(workdir)}
    assert listed["link"].type == FileType.SYMLINK
    assert listed["link"].symlink_target == f"{workdir}/target.txt"


def test_list_follows_symlinked_directory(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/real/inner.txt", "i")
    sandbox.commands.run(f"ln -s {workdir}/real {workdir}/alias")
    names = [e.name for e in sandbox.files.list(f"{workdir}/alias")]
    assert names == ["inner.txt"]


def test_get_info_missing(sandbox: Sandbox, workdir: str) -> None:
    with pytest.raises(NotFoundException):
        sandbox.files.get_info(f"{workdir}/missing")


def test_exists(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/e.txt", "e")
    assert sandbox.files.exists(f"{workdir}/e.txt") is True
    assert sandbox.files.exists(workdir) is True
    assert sandbox.files.exists(f"{workdir}/nope") is False


def test_make_dir(sandbox: Sandbox, workdir: str) -> None:
    assert sandbox.files.make_dir(f"{workdir}/new/nested") is True
    info = sandbox.files.get_info(f"{workdir}/new/nested")
    assert (info.type, info.owner) == (FileType.DIR, "user")
    assert sandbox.files.make_dir(f"{workdir}/new/nested") is False
    sandbox.files.write(f"{workdir}/plain", "p")
    with pytest.raises(InvalidArgumentException):
        sandbox.files.make_dir(f"{workdir}/plain")


def test_rename(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/old.txt", "content")
    info = sandbox.files.rename(f"{workdir}/old.txt", f"{workdir}/sub/new.txt")
    assert (info.name, info.path) == ("new.txt", f"{workdir}/sub/new.txt")
    assert sandbox.files.exists(f"{workdir}/old.txt") is False
    assert sandbox.files.read(f"{workdir}/sub/new.txt") == "content"
    with pytest.raises(NotFoundException):
        sandbox.files.rename(f"{workdir}/old.txt", f"{workdir}/again.txt")


def test_rename_directory(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/dir/f.txt", "f")
    sandbox.files.rename(f"{workdir}/dir", f"{workdir}/moved")
    assert sandbox.files.read(f"{workdir}/moved/f.txt") == "f"


def test_rename_directory_into_itself_is_invalid(sandbox: Sandbox, workdir: str) -> None:
    """rename(2) answers EINVAL; found by the envd fuzzer as a 500 (an empty source is home)."""
    sandbox.files.make_dir(f"{workdir}/dir")
    with pytest.raises(InvalidArgumentException):
        sandbox.files.rename(f"{workdir}/dir", f"{workdir}/dir/inside")
    assert sandbox.files.exists(f"{workdir}/dir")


def test_remove(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/r.txt", "r")
    sandbox.files.write(f"{workdir}/tree/a/b.txt", "b")
    sandbox.files.remove(f"{workdir}/r.txt")
    sandbox.files.remove(f"{workdir}/tree")
    assert sandbox.files.exists(f"{workdir}/r.txt") is False
    assert sandbox.files.exists(f"{workdir}/tree") is False
    sandbox.files.remove(f"{workdir}/never-existed")  # not an error, like os.RemoveAll


def test_remove_symlink_keeps_target(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/keep/k.txt", "k")
    sandbox.commands.run(f"ln -s {workdir}/keep {workdir}/link")
    sandbox.files.remove(f"{workdir}/link")
    assert sandbox.files.read(f"{workdir}/keep/k.txt") == "k"


def test_metadata(sandbox: Sandbox, workdir: str) -> None:
    path = f"{workdir}/m.txt"
    info = sandbox.files.write(path, "m", metadata={"owner-team": "infra", "Stage": "test 1"})
    assert info.metadata == {"owner-team": "infra", "stage": "test 1"}
    assert sandbox.files.get_info(path).metadata == {"owner-team": "infra", "stage": "test 1"}
    listed = {e.name: e for e in sandbox.files.list(workdir)}
    assert listed["m.txt"].metadata == {"owner-team": "infra", "stage": "test 1"}
    # Each upload replaces the metadata; one without any clears it.
    sandbox.files.write(path, "m2", metadata={"only": "this"})
    assert sandbox.files.get_info(path).metadata == {"only": "this"}
    sandbox.files.write(path, "m3")
    assert not sandbox.files.get_info(path).metadata


def test_metadata_on_octet_stream_and_write_files(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/o.bin", io.BytesIO(b"o"), metadata={"k": "v"})
    assert sandbox.files.get_info(f"{workdir}/o.bin").metadata == {"k": "v"}
    sandbox.files.write_files(
        [
            WriteEntry(path=f"{workdir}/p1", data="1"),
            WriteEntry(path=f"{workdir}/p2", data="2"),
        ],
        metadata={"batch": "yes"},
    )
    assert sandbox.files.get_info(f"{workdir}/p2").metadata == {"batch": "yes"}


def test_command_as_user_cannot_write_root_home(sandbox: Sandbox) -> None:
    result = sandbox.commands.run("echo x > /root/denied.txt; echo rc=$?")
    assert "rc=1" in result.stdout
    assert "Permission denied" in result.stderr
    assert sandbox.files.exists("/root/denied.txt") is False


def test_download_and_upload_urls_unsigned(sandbox: Sandbox, workdir: str) -> None:
    import httpx

    sandbox.files.write(f"{workdir}/u.txt", "via url")
    url = sandbox.download_url(f"{workdir}/u.txt")
    response = httpx.get(url)
    assert response.status_code == 200
    assert response.text == "via url"
    assert response.headers["content-disposition"] == 'inline; filename="u.txt"'
    upload = sandbox.upload_url(f"{workdir}/up.txt")
    r = httpx.post(upload, files={"file": ("up.txt", b"uploaded")})
    assert r.status_code == 200
    assert r.json() == [{"path": f"{workdir}/up.txt", "name": "up.txt", "type": "file"}]
    assert sandbox.files.read(f"{workdir}/up.txt") == "uploaded"
    assert sandbox.files.get_info(f"{workdir}/up.txt").owner == "user"


def test_write_files_relative_paths(sandbox: Sandbox, workdir: str) -> None:
    relative = workdir.removeprefix("/home/user/")
    infos = sandbox.files.write_files(
        [
            WriteEntry(path=f"{relative}/r1.txt", data="1"),
            WriteEntry(path=f"~/{relative}/sub/r2.txt", data="2"),
        ]
    )
    assert sorted(i.path for i in infos) == [f"{workdir}/r1.txt", f"{workdir}/sub/r2.txt"]
    assert sandbox.files.read(f"{workdir}/sub/r2.txt") == "2"


def test_unicode_and_special_names(sandbox: Sandbox, workdir: str) -> None:
    path = f"{workdir}/spaß & co/名前 #1.txt"
    info = sandbox.files.write(path, "ünïcödé")
    assert info.path == path
    assert sandbox.files.read(path) == "ünïcödé"
    names = [e.name for e in sandbox.files.list(f"{workdir}/spaß & co")]
    assert names == ["名前 #1.txt"]
    assert sandbox.commands.run(f"cat '{path}'").stdout == "ünïcödé"


def test_metadata_limits(sandbox: Sandbox, envd_url: str, workdir: str) -> None:
    import httpx

    path = f"{workdir}/limits.txt"
    with pytest.raises(InvalidArgumentException):
        sandbox.files.write(path, "x", metadata={"k" * 247: "v"})
    with pytest.raises(InvalidArgumentException):
        sandbox.files.write(path, "x", metadata={f"k{i}": "v" * 500 for i in range(9)})
    with pytest.raises(InvalidArgumentException):
        sandbox.files.write(path, "x", metadata={"k": "new\nline"})
    assert not sandbox.files.exists(path)  # rejected before anything was written
    sandbox.files.write(path, "x", metadata={"k" * 246: "v"})
    assert sandbox.files.get_info(path).metadata == {"k" * 246: "v"}
    # Raw headers: an empty key is ignored, the first of repeated headers wins.
    response = httpx.post(
        f"{envd_url}/files",
        params={"path": path},
        content=b"y",
        headers=[
            ("Content-Type", "application/octet-stream"),
            ("X-Metadata-", "ignored"),
            ("X-Metadata-Dup", "first"),
            ("X-Metadata-Dup", "second"),
        ],
    )
    assert response.status_code == 200
    assert response.json()[0]["metadata"] == {"dup": "first"}


def test_file_api_acts_as_root_then_hands_over(sandbox: Sandbox) -> None:
    """As in infra's envd, /files and the filesystem RPCs run as root and give what they create
    to the requesting user; only commands are confined to the user's permissions."""
    path = "/root/handed-over/by-user.txt"
    try:
        info = sandbox.files.write(path, "mine")  # as the default user
        assert info.path == path
        entry = sandbox.files.get_info(path)
        assert (entry.owner, entry.group) == ("user", "user")
        assert sandbox.files.get_info("/root").permissions == "drwx------"
        with pytest.raises(CommandExitException):
            sandbox.commands.run(f"cat {path}")  # the user's own shell cannot get there
    finally:
        sandbox.files.remove("/root/handed-over")


def test_read_while_the_file_is_replaced(sandbox: Sandbox, workdir: str) -> None:
    # A writer that atomically replaces the file with one of another length, over and over
    # (as a counter that goes from 9 to 10 does): every read gets one whole version, never a
    # response whose Content-Length belongs to the file it replaced.
    short, long = "s" * 10, "L" * 70_000
    loop = (
        f"cd {workdir}; while true; do printf {short} > a.tmp; mv a.tmp f; "
        f"head -c 70000 /dev/zero | tr '\\0' L > b.tmp; mv b.tmp f; done"
    )
    writer = sandbox.commands.run(loop, background=True)
    try:
        sandbox.commands.run(f"while [ ! -f {workdir}/f ]; do sleep 0.01; done")
        seen = {sandbox.files.read(f"{workdir}/f") for _ in range(300)}
    finally:
        writer.kill()
    assert seen <= {short, long}
    assert seen == {short, long}  # both versions were read: the race was exercised
