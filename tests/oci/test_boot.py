"""An image without Python or libc boots as a guest: our init mounts its ext4 as the root, the
envd bundle runs from /opt/aenv, and user `user` reads and writes its home through envd.

Slow (a QEMU boot); uses the envd bundle from `make envd-bundle` and is skipped without it."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from aenv.guest.bundle import build_envd_drive
from aenv.guest.initramfs import build_initramfs
from aenv.guest.kernel import fetch_kernel
from aenv.guest.rootfs import BaseRootfs
from aenv.oci import rootfs_from_image
from aenv.runtime.qemu import QemuDriver
from tests.oci.test_rootfs import busybox_image
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
from tests.runtime.qemu_vm.test_envd_in_guest import BUNDLE, wait_healthy

pytestmark = pytest.mark.slow


async def test_busybox_image_boots_with_envd(
    driver: QemuDriver,  # noqa: F811
    places: Places,  # noqa: F811
    nets: NetnsPool,  # noqa: F811
    publish,
    tmp_path: Path,
) -> None:
    if not BUNDLE.is_file():
        pytest.skip(f"no envd bundle at {BUNDLE} (make envd-bundle)")
    os.environ.setdefault("AENV_GUEST_CACHE", str(REPO / "build" / "guest-cache"))
    kernel = await fetch_kernel()
    initrd = await build_initramfs(kernel)
    rootfs = await rootfs_from_image(
        publish(busybox_image()), tmp_path / "rootfs.ext4", cache=tmp_path / "oci"
    )
    drive = await build_envd_drive(BUNDLE.parent, tmp_path / "envd.ext4")
    image = BaseRootfs(tree=tmp_path, image=rootfs.image)
    vm, netns = await boot_template(driver, Images(kernel, initrd, image, drive), places, nets)
    try:
        try:
            await wait_healthy(netns)
        except TimeoutError as exc:
            console = vm.console_log.read_text(errors="replace")[-3000:]
            raise TimeoutError(f"{exc}; guest console:\n{console}") from exc
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
            headers={
                "Content-Type": "application/json",
                "Authorization": "Basic " + base64.b64encode(b"user:").decode(),
            },
        )  # fmt: skip
        assert status == 200, body
        entry = json.loads(body)["entry"]
        assert (entry["owner"], entry["size"]) == ("user", "17"), entry
    finally:
        await vm.stop()
