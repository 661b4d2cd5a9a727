"""An image without Python or libc boots as a guest: our init mounts its ext4 as the root, the
envd bundle runs from /opt/aenv, and user `user` reads and writes its home through envd. The same
holds for a musl (Alpine-like) image without glibc: envd brings its own glibc and loader, and the
image's musl programs run through it.

Slow (a QEMU boot); uses the test servers' envd bundle (`tests.support.guest.envd_bundle`)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from aenv.guest.bundle import build_envd_drive
from aenv.guest.initramfs import build_initramfs
from aenv.guest.kernel import fetch_kernel
from aenv.guest.rootfs import BaseRootfs
from aenv.oci import rootfs_from_image
from aenv.runtime.qemu import QemuDriver
from tests.envd.helpers import STREAM_HEADERS, envelope, parse_envelopes
from tests.oci.images import Image, Publish
from tests.oci.test_rootfs import busybox_image, musl_image
from tests.runtime.qemu_vm.conftest import (  # noqa: F401 - session fixtures used by name
    REPO,
    Images,
    Places,
    boot_template,
    cgroups,
    driver,
    nets,
    places,
)
from tests.runtime.qemu_vm.netns import NetnsPool, http
from tests.runtime.qemu_vm.test_envd_in_guest import wait_healthy
from tests.support.guest import GUEST_CACHE, envd_bundle

pytestmark = pytest.mark.slow


@asynccontextmanager
async def booted(
    image: Image,
    driver: QemuDriver,  # noqa: F811
    places: Places,  # noqa: F811
    nets: NetnsPool,  # noqa: F811
    publish: Callable[..., str],
    tmp_path: Path,
) -> AsyncIterator[str]:
    """Publish `image`, make it a guest rootfs, boot it with the envd bundle and yield the netns
    once envd is healthy; the VM is stopped however the body ends."""
    kernel = await fetch_kernel(GUEST_CACHE)
    initrd = await build_initramfs(kernel, GUEST_CACHE)
    rootfs = await rootfs_from_image(
        publish(image), tmp_path / "rootfs.ext4", cache=tmp_path / "oci"
    )
    drive = await build_envd_drive(await asyncio.to_thread(envd_bundle), tmp_path / "envd.ext4")
    base = BaseRootfs(tree=tmp_path, image=rootfs.image)
    vm, netns = await boot_template(driver, Images(kernel, initrd, base, drive), places, nets)
    try:
        try:
            await wait_healthy(netns)
        except TimeoutError as exc:
            console = vm.console_log.read_text(errors="replace")[-3000:]
            raise TimeoutError(f"{exc}; guest console:\n{console}") from exc
        yield netns
    finally:
        await vm.stop()


def basic_auth(user: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:".encode()).decode()


async def run(netns: str, user: str, cmd: str, *args: str) -> tuple[int, bytes]:
    """Run a process through envd's process.Process/Start; (exit code, stdout)."""
    body = envelope({"process": {"cmd": cmd, "args": list(args)}, "stdin": False})
    headers = {**STREAM_HEADERS, "Authorization": basic_auth(user)}
    status, reply = await http(netns, "POST", "/process.Process/Start", body=body, headers=headers)
    assert status == 200, reply
    events = [message["event"] for flags, message in parse_envelopes(reply) if flags == 0]
    stdout = b"".join(
        base64.b64decode(e["data"]["stdout"]) for e in events if "stdout" in e.get("data", {})
    )
    assert "end" in events[-1], events
    return events[-1]["end"].get("exitCode", 0), stdout


async def glibc_files(netns: str, top: str) -> list[str]:
    """glibc's libc and loader under `top`, on that filesystem only (/ stays off /opt/aenv, where
    envd's bundle is mounted), searched by root so that no unreadable directory hides one."""
    code, out = await run(
        netns, "root", "/bin/busybox", "find", top, "-xdev",
        "(", "-name", "libc.so.6", "-o", "-name", "ld-linux-x86-64.so.2", ")",
    )  # fmt: skip
    assert code == 0, out
    return out.decode().split()


async def test_busybox_image_boots_with_envd(
    driver: QemuDriver,  # noqa: F811
    places: Places,  # noqa: F811
    nets: NetnsPool,  # noqa: F811
    publish: Publish,
    tmp_path: Path,
) -> None:
    async with booted(busybox_image(), driver, places, nets, publish, tmp_path) as netns:
        status, body = await http(netns, "GET", "/files?path=/etc/passwd&username=user")
        assert status == 200 and b"user:x:1000:1000::/home/user:/bin/sh" in body

        form = (
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="hello.txt"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\nhi from the image\r\n--b--\r\n"
        )
        status, body = await http(
            netns, "POST", "/files?path=/home/user/hello.txt&username=user", body=form,
            headers={"Content-Type": "multipart/form-data; boundary=b"},
        )  # fmt: skip
        assert status == 200, body
        status, body = await http(
            netns, "POST", "/filesystem.Filesystem/Stat",
            body=json.dumps({"path": "/home/user/hello.txt"}).encode(),
            headers={"Content-Type": "application/json", "Authorization": basic_auth("user")},
        )  # fmt: skip
        assert status == 200, body
        entry = json.loads(body)["entry"]
        assert (entry["owner"], entry["size"]) == ("user", "17"), entry


async def test_musl_image_boots_with_envd(
    driver: QemuDriver,  # noqa: F811
    places: Places,  # noqa: F811
    nets: NetnsPool,  # noqa: F811
    publish: Publish,
    tmp_path: Path,
) -> None:
    """An Alpine-like image with musl and no glibc: envd (glibc from its bundle) serves it, and a
    program of the image runs through envd on the image's musl."""
    (tmp_path / "musl").mkdir()
    image = musl_image(tmp_path / "musl")
    async with booted(image, driver, places, nets, publish, tmp_path) as netns:
        status, body = await http(netns, "GET", "/files?path=/etc/os-release&username=user")
        assert status == 200 and b"ID_LIKE=alpine" in body, body

        code, out = await run(netns, "user", "/usr/bin/musl-hello")
        assert code == 0 and re.fullmatch(rb"musl-hello pid=\d+ glibc=no\n", out), (code, out)

        # No glibc anywhere in the image's root; the same search finds the one in envd's bundle.
        assert await glibc_files(netns, "/") == []
        assert "/opt/aenv/_internal/libc.so.6" in await glibc_files(netns, "/opt/aenv")
