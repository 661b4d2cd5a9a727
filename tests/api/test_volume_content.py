"""E2B's volume content API over a node on doubles, served on loopback and driven by the
unmodified Python SDK's `AsyncVolume` file calls; then hostile volume contents. A guest's 9p
server (mapped-xattr) stores the symlinks, FIFOs and device nodes a guest makes as plain files
marked in `user.virtfs.mode`: those are planted here as the VMM would, next to real host
symlinks, hard links, FIFOs and device nodes, and every read, write and change through them is
refused with the host untouched. The same attack from inside a real guest is in
tests/e2e/volumes/test_content.py."""

from __future__ import annotations

import asyncio
import os
import stat
import struct
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import AsyncVolume
from e2b.exceptions import (
    AuthenticationException,
    VolumeException,
    VolumePathNotFoundException,
)
from e2b.volume.types import VolumeFileType

from tests.api.test_routes import KEY, error, served
from tests.doubles.node import double_node


def _mark(path: Path, mode: int) -> None:
    """What the VMM's 9p server (mapped-xattr) records for a guest's special file."""
    os.setxattr(path, "user.virtfs.mode", struct.pack("<I", mode))


async def test_files_with_the_sdk(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        volume = await AsyncVolume.create("files", api_key=KEY, api_url=str(api.base_url))
        at: dict[str, Any] = {"api_url": str(api.base_url)}
        root = node.orchestrator.volumes.directory(volume.volume_id)

        written = await volume.write_file("/a.txt", "hello", **at)
        assert (written.name, written.path, written.size) == ("a.txt", "/a.txt", 5)
        assert written.type == VolumeFileType.FILE and (root / "a.txt").read_text() == "hello"
        assert await volume.read_file("/a.txt", **at) == "hello"
        await volume.write_file("a.txt", b"\x00\x01" * 70_000, mode=0o640, uid=1000, **at)
        assert await volume.read_file("/a.txt", format="bytes", **at) == b"\x00\x01" * 70_000
        streamed = b"".join([c async for c in await volume.read_file("a.txt", "stream", **at)])
        assert streamed == b"\x00\x01" * 70_000
        info = await volume.get_info("/a.txt", **at)
        assert (info.mode, info.uid, info.gid, info.size) == (0o640, 1000, 0, 140_000)
        assert [p.name for p in root.iterdir()] == ["a.txt"]  # no upload left beside it

        made = await volume.make_dir("/d/e", force=True, mode=0o700, **at)
        assert (made.type, made.path, made.mode) == (VolumeFileType.DIRECTORY, "/d/e", 0o700)
        with pytest.raises(VolumeException, match="already exists"):
            await volume.make_dir("/d/e", **at)
        with pytest.raises(VolumePathNotFoundException):
            await volume.make_dir("/x/y", **at)
        await volume.write_file("/d/e/f", "deep", **at)
        await volume.write_file("/n/o/p", "parents", force=True, **at)
        assert (root / "n/o/p").read_text() == "parents"
        listed = await volume.list("/", **at)
        assert [(e.path, e.type) for e in listed] == [
            ("/a.txt", VolumeFileType.FILE),
            ("/d", VolumeFileType.DIRECTORY),
            ("/n", VolumeFileType.DIRECTORY),
        ]
        deep = [e.path for e in await volume.list("/", depth=3, **at)]
        assert deep == ["/a.txt", "/d", "/d/e", "/d/e/f", "/n", "/n/o", "/n/o/p"]

        changed = await volume.update_metadata("/d", uid=7, gid=8, mode=0o711, **at)
        assert (changed.uid, changed.gid, changed.mode, changed.type) == (7, 8, 0o711, "directory")
        assert await volume.exists("/d/e/f", **at) and not await volume.exists("/zz", **at)
        await volume.remove("/d", **at)
        await volume.remove("/a.txt", **at)
        assert sorted(p.name for p in root.iterdir()) == ["n"]
        with pytest.raises(VolumePathNotFoundException):
            await volume.remove("/a.txt", **at)
        with pytest.raises(VolumePathNotFoundException):
            await volume.read_file("/a.txt", **at)

        stranger = AsyncVolume(volume.volume_id, "files", token="not-the-token")
        with pytest.raises(AuthenticationException):
            await stranger.list("/", **at)


async def _declared_huge(url: httpx.URL, base: str, token: str) -> str:
    """The answer to an upload declaring 5 GiB, sent without its body (no client sends that)."""
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(
        f"PUT {base}/file?path=/big HTTP/1.1\r\nHost: node\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Length: {5 << 30}\r\n\r\n".encode()
    )
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    writer.close()
    assert head.startswith("HTTP/1.1 413"), head
    length = int(head.lower().split("content-length:")[1].split("\r\n")[0])
    return (await reader.readexactly(length)).decode()


async def test_bad_content_requests_get_json_errors(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        made = (await api.post("/volumes", json={"name": "v"})).json()
        base = f"/volumecontent/{made['volumeID']}"
        bearer = {"Authorization": f"Bearer {made['token']}"}
        root = node.orchestrator.volumes.directory(made["volumeID"])
        async with httpx.AsyncClient(base_url=str(api.base_url), headers=bearer) as vol:
            assert error(await api.get(base + "/dir", params={"path": "/"}), 401)  # API key only
            assert error(await vol.get("/volumecontent/vol_nope/dir", params={"path": "/"}), 401)
            assert "'path' is required" in error(await vol.get(base + "/dir"), 400)
            assert "'x' is not supported" in error(
                await vol.get(base + "/dir", params={"path": "/", "x": "1"}), 400
            )
            for params in ({"depth": "0"}, {"depth": "-1"}, {"depth": "a"}):
                assert error(await vol.get(base + "/dir", params={"path": "/", **params}), 400)
            assert error(await vol.put(base + "/file", params={"path": "/f", "mode": "9999"}), 400)
            assert error(await vol.put(base + "/file", params={"path": "/f", "force": "x"}), 400)
            assert "'owner' is not supported" in error(
                await vol.patch(base + "/path", params={"path": "/"}, json={"owner": 1}), 400
            )
            assert "root" in error(await vol.delete(base + "/path", params={"path": "/"}), 400)
            assert error(await vol.get(base + "/file", params={"path": "/"}), 400)
            await vol.post(base + "/dir", params={"path": "/d"})
            assert "is a directory" in error(
                await vol.put(base + "/file", params={"path": "/d"}, content=b"x"), 409
            )
            assert "at most" in await _declared_huge(api.base_url, base, made["token"])
            root_info = (await vol.get(base + "/path", params={"path": "/"})).json()
            assert (root_info["name"], root_info["type"], root_info["path"]) == (
                "/",
                "directory",
                "/",
            )
        assert [p.name for p in root.iterdir()] == ["d"]


async def test_setuid_modes_and_device_types_are_refused(tmp_path: Path) -> None:
    """A set-uid root file, or a device node, put in a volume by its token would act in every
    guest that mounts it: such modes answer 400 naming them, and nothing changes."""
    async with double_node(tmp_path) as node, served(node) as api:
        volume = await AsyncVolume.create("setid", api_key=KEY, api_url=str(api.base_url))
        at: dict[str, Any] = {"api_url": str(api.base_url)}
        root = node.orchestrator.volumes.directory(volume.volume_id)
        await volume.write_file("/tool", "#!/bin/sh\n", mode=0o755, **at)
        with pytest.raises(VolumeException, match="setuid or setgid"):
            await volume.update_metadata("/tool", uid=0, mode=0o4755, **at)
        base = f"/volumecontent/{volume.volume_id}"
        bearer = {"Authorization": f"Bearer {volume.token}"}
        async with httpx.AsyncClient(base_url=str(api.base_url), headers=bearer) as vol:
            for mode, named in [
                (0o4755, "setuid or setgid"),
                (0o2755, "setuid or setgid"),
                (0o6777, "setuid or setgid"),
                (stat.S_IFCHR | 0o666, "a device or other file type"),
                (stat.S_IFBLK | 0o600, "a device or other file type"),
            ]:
                body = {"mode": mode}
                patched = await vol.patch(base + "/path", params={"path": "/tool"}, json=body)
                assert named in error(patched, 400)
                query = {"path": "/new", "mode": str(mode)}
                assert named in error(
                    await vol.put(base + "/file", params=query, content=b"x"), 400
                )
                assert named in error(await vol.post(base + "/dir", params=query), 400)
                assert "'mode'" in error(await vol.put(base + "/file", params=query), 400)
            # The sticky bit is a permission bit like the others (a shared /tmp-like directory).
            sticky = await vol.post(base + "/dir", params={"path": "/tmp", "mode": str(0o1777)})
            assert sticky.status_code == 201 and sticky.json()["mode"] == 0o1777
        info = await volume.get_info("/tool", **at)
        assert info.mode == 0o755
        assert sorted(p.name for p in root.iterdir()) == ["tmp", "tool"]


async def test_hostile_entries_are_never_followed(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        made = (await api.post("/volumes", json={"name": "v"})).json()
        base = f"/volumecontent/{made['volumeID']}"
        root = node.orchestrator.volumes.directory(made["volumeID"])
        outside = tmp_path / "host"
        outside.mkdir()
        secret = outside / "secret"
        secret.write_text("host secret")
        (root / "real-link").symlink_to(secret)
        (root / "real-dir-link").symlink_to(outside)
        os.link(secret, root / "hard")
        os.mkfifo(root / "fifo")
        os.mknod(root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        (root / "guest-link").write_text(str(secret))  # a guest's symlink, as 9p stores it
        _mark(root / "guest-link", stat.S_IFLNK | 0o777)
        (root / "guest-fifo").touch()
        _mark(root / "guest-fifo", stat.S_IFIFO | 0o644)
        before = {p.name: (p.lstat().st_ino, p.lstat().st_mtime_ns) for p in root.iterdir()}

        bearer = {"Authorization": f"Bearer {made['token']}"}
        async with httpx.AsyncClient(base_url=str(api.base_url), headers=bearer) as vol:
            listed = (await vol.get(base + "/dir", params={"path": "/", "depth": 3})).json()
            types = {e["name"]: (e["type"], e.get("target")) for e in listed}
            assert types == {
                "fifo": ("unknown", None),
                "guest-fifo": ("unknown", None),
                "guest-link": ("symlink", str(secret)),
                "hard": ("file", None),
                "null": ("unknown", None),
                "real-dir-link": ("symlink", str(outside)),
                "real-link": ("symlink", str(secret)),
            }
            for name in before:
                path = {"path": f"/{name}"}
                assert error(await vol.get(base + "/file", params=path), 400)
                assert error(await vol.put(base + "/file", params=path, content=b"pwn"), 400)
                assert error(
                    await vol.patch(base + "/path", params=path, json={"mode": 0o777}), 400
                )
            for through in ("/real-dir-link/secret", "/real-dir-link/new", "/../host/secret"):
                path = {"path": through}
                assert error(await vol.get(base + "/file", params=path), 400)
                assert error(await vol.put(base + "/file", params=path, content=b"pwn"), 400)
                assert error(await vol.get(base + "/dir", params=path), 400)
                assert error(await vol.post(base + "/dir", params=path), 400)
                assert error(await vol.delete(base + "/path", params=path), 400)
            write_through = {"path": "/real-dir-link/new/f", "force": "true"}
            assert error(await vol.put(base + "/file", params=write_through, content=b"x"), 400)
            after = {p.name: (p.lstat().st_ino, p.lstat().st_mtime_ns) for p in root.iterdir()}
            assert after == before
            assert sorted(p.name for p in outside.iterdir()) == ["secret"]
            assert (
                secret.read_text() == "host secret" and stat.S_IMODE(secret.stat().st_mode) != 0o777
            )
            # Removing a link removes the link, never what it names.
            for name in ("real-link", "real-dir-link", "guest-link", "hard"):
                gone = await vol.delete(base + "/path", params={"path": f"/{name}"})
                assert gone.status_code == 204, gone.text
        assert secret.read_text() == "host secret" and secret.stat().st_nlink == 1
        assert sorted(p.name for p in root.iterdir()) == ["fifo", "guest-fifo", "null"]
