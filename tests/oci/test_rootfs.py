"""Guest root filesystems from images: the read-only ext4 our init boots, inspected with
debugfs (no mount), with the user, mount points and /etc files the guest needs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from aenv.guest.cmdline import ROOT_LABEL
from aenv.oci import DigestMismatchError, ImageConfig, rootfs_from_image
from tests.oci.images import Image, Publish, directory, entry, symlink


def debugfs(image: Path, request: str) -> str:
    return subprocess.run(
        ["debugfs", "-R", request, str(image)], check=True, capture_output=True, text=True
    ).stdout


def inode(image: Path, path: str) -> tuple[str, int, int, int]:
    """(type, permission bits, uid, gid) of `path` in the image."""
    out = debugfs(image, f"stat {path}")
    mode = re.search(r"Type: (\w+)\s+Mode:\s+(\d+)", out)
    owner = re.search(r"User:\s+(\d+)\s+Group:\s+(\d+)", out)
    assert mode and owner, out
    return mode[1], int(mode[2], 8), int(owner[1]), int(owner[2])


def busybox_image() -> Image:
    """Nothing but a static busybox: no libc, no Python, no /etc."""
    return Image(
        [[
            directory("bin"),
            entry("bin/busybox", Path("/bin/busybox").read_bytes(), mode=0o755),
            symlink("bin/sh", "busybox"),
        ]],
        config={"Env": ["PATH=/bin", "GREETING=a=b"], "WorkingDir": "/work", "Cmd": ["sh"]},
    )  # fmt: skip


MUSL_LOADER = "/lib/ld-musl-x86_64.so.1"  # musl's libc.so is its own dynamic loader
MUSL_HELLO = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>

int main(void) {
    /* glibc exports gnu_get_libc_version and musl does not: asking at run time shows which
       libc the loader actually mapped, not which headers the program was compiled against. */
    void *glibc = dlsym(RTLD_DEFAULT, "gnu_get_libc_version");
    printf("musl-hello pid=%d glibc=%s\n", (int)getpid(), glibc ? "yes" : "no");
    return 0;
}
"""


def musl_image(work: Path) -> Image:
    """An Alpine-like image: musl's loader in /lib, a static busybox as the shell, and
    /usr/bin/musl-hello, a program compiled here with musl-gcc and linked dynamically against
    musl. No glibc at all, so anything that runs in it brings its own libc or uses musl."""
    (work / "hello.c").write_text(MUSL_HELLO)
    program = work / "musl-hello"
    subprocess.run(["musl-gcc", "-O2", "-o", program, work / "hello.c"], check=True)
    headers = subprocess.run(
        ["readelf", "-l", "-d", program], check=True, capture_output=True, text=True
    ).stdout
    # Dynamic (musl-gcc links static only on request), through musl's loader, needing only musl.
    assert f"[Requesting program interpreter: {MUSL_LOADER}]" in headers, headers
    assert re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", headers) == ["libc.so"], headers
    os_release = (
        b'NAME="musl test image"\nID=musl-test\nID_LIKE=alpine\nPRETTY_NAME="musl libc, no glibc"\n'
    )
    return Image(
        [
            [
                directory("bin"),
                entry("bin/busybox", Path("/bin/busybox").read_bytes(), mode=0o755),
                symlink("bin/sh", "busybox"),
                directory("lib"),
                # Debian's /lib/ld-musl-x86_64.so.1 is a symlink into the package's own directory;
                # the image gets the real file under the name Alpine uses.
                entry(MUSL_LOADER[1:], Path(MUSL_LOADER).resolve().read_bytes(), mode=0o755),
                directory("etc"),
                entry("etc/os-release", os_release),
            ],
            [
                directory("usr"),
                directory("usr/bin"),
                entry("usr/bin/musl-hello", program.read_bytes(), mode=0o755),
            ],
        ],
        config={"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "Cmd": ["/bin/sh"]},
    )


async def test_busybox_only_image(publish: Publish, tmp_path: Path) -> None:
    ref = publish(busybox_image())
    dest = tmp_path / "out" / "rootfs.ext4"
    rootfs = await rootfs_from_image(ref, dest, cache=tmp_path / "oci")
    assert rootfs.image == dest and rootfs.reference == ref
    assert rootfs.config == ImageConfig(
        env=("PATH=/bin", "GREETING=a=b"), working_dir="/work", cmd=("sh",)
    )
    assert rootfs.config.env_dict() == {"PATH": "/bin", "GREETING": "a=b"}
    assert [p.name for p in dest.parent.iterdir()] == ["rootfs.ext4"]  # no work tree left

    label = subprocess.run(["e2label", str(dest)], capture_output=True, text=True, check=True)
    assert label.stdout.strip() == ROOT_LABEL
    listing = debugfs(dest, "ls /")
    for name in ("bin", "proc", "sys", "dev", "run", "tmp", "opt", "etc", "home", "root"):
        assert re.search(rf"\b{name}\b", listing), (name, listing)
    assert inode(dest, "/tmp")[:2] == ("directory", 0o1777)
    assert inode(dest, "/opt/aenv")[:2] == ("directory", 0o755)
    assert inode(dest, "/home/user")[2:] == (1000, 1000)
    passwd = debugfs(dest, "cat /etc/passwd")
    assert passwd == "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n"
    assert debugfs(dest, "cat /etc/group") == "root:x:0:\nuser:x:1000:\n"
    assert debugfs(dest, "cat /etc/hostname") == "sandbox\n"
    assert "localhost" in debugfs(dest, "cat /etc/hosts")
    assert inode(dest, "/bin/busybox")[:2] == ("regular", 0o755)
    assert "busybox" in debugfs(dest, "stat /bin/sh")  # fast symlink target


async def test_distro_like_image_keeps_its_files(publish: Publish, tmp_path: Path) -> None:
    passwd = b"root:x:0:0:root:/root:/bin/bash\nnode:x:1000:1000::/home/node:/bin/sh\n"
    etc = [
        directory("etc"),
        entry("etc/passwd", passwd),
        entry("etc/group", b"root:x:0:\nnode:x:1000:\n"),
        entry("etc/shadow", b"root:*:19000:0:99999:7:::\n", mode=0o640, gid=42),
        directory("etc/sudoers.d", mode=0o750),
        directory("etc/skel"),
        entry("etc/skel/.bashrc", b"# rc\n"),
        entry("etc/hostname", b"image-host\n"),
        symlink("etc/resolv.conf", "../run/systemd/resolve/stub-resolv.conf"),
        directory("usr/bin"),
        entry("usr/bin/bash", b"\x7fELF", mode=0o755),
        symlink("bin", "usr/bin"),
    ]  # fmt: skip
    ref = publish(Image([etc], config={"User": "node", "Entrypoint": ["/bin/bash", "-c"]}))
    dest = tmp_path / "rootfs.ext4"
    rootfs = await rootfs_from_image(ref, dest, cache=tmp_path / "oci")
    assert rootfs.config.user == "node" and rootfs.config.entrypoint == ("/bin/bash", "-c")

    lines = debugfs(dest, "cat /etc/passwd").splitlines()
    assert lines[-1] == "user:x:1000:1000::/home/user:/bin/bash"  # bash found through /bin
    assert lines[0].startswith("root:") and len(lines) == 3
    shadow = debugfs(dest, "cat /etc/shadow").splitlines()
    assert shadow[0].startswith("root:*") and shadow[1].startswith("user:!:")
    assert inode(dest, "/etc/shadow") == ("regular", 0o640, 0, 42)
    assert debugfs(dest, "cat /etc/sudoers.d/user") == "user ALL=(ALL) NOPASSWD:ALL\n"
    assert inode(dest, "/etc/sudoers.d/user")[1] == 0o440
    assert debugfs(dest, "cat /home/user/.bashrc") == "# rc\n"
    assert inode(dest, "/home/user/.bashrc")[2:] == (1000, 1000)
    assert debugfs(dest, "cat /etc/hostname") == "image-host\n"  # the image's own wins
    assert "stub-resolv.conf" in debugfs(dest, "stat /etc/resolv.conf")  # init replaces it


async def test_unpacked_metadata_reaches_the_ext4(publish: Publish, tmp_path: Path) -> None:
    layer = [
        entry("owned", b"o", uid=1234, gid=2345, mode=0o4750),
        entry("tagged", b"t", xattrs={"user.origin": "layer1"}),
        entry("first", b"same"),
        entry("second", kind=b"1", link="first"),
    ]
    dest = tmp_path / "rootfs.ext4"
    await rootfs_from_image(publish(Image([layer])), dest, cache=tmp_path / "oci")
    assert inode(dest, "/owned") == ("regular", 0o4750, 1234, 2345)
    assert "user.origin" in debugfs(dest, "ea_list /tagged")
    first, second = debugfs(dest, "stat /first"), debugfs(dest, "stat /second")
    assert "Links: 2" in first
    assert re.search(r"Inode: (\d+)", first)[1] == re.search(r"Inode: (\d+)", second)[1]  # type: ignore[index]


async def test_many_small_files_fit(publish: Publish, tmp_path: Path) -> None:
    """More entries than a byte-sized ext4 would have inodes for."""
    layer = [directory("many"), *(entry(f"many/f{i}", b"") for i in range(12000))]
    dest = tmp_path / "rootfs.ext4"
    await rootfs_from_image(publish(Image([layer])), dest, cache=tmp_path / "oci")
    assert "f11999" in debugfs(dest, "ls /many")


async def test_layer_not_matching_its_diff_id(publish: Publish, tmp_path: Path) -> None:
    ref = publish(Image([[entry("file", b"x")]], wrong_diff_ids=True))
    dest = tmp_path / "out" / "rootfs.ext4"
    with pytest.raises(DigestMismatchError, match="uncompressed"):
        await rootfs_from_image(ref, dest, cache=tmp_path / "oci")
    assert list(dest.parent.iterdir()) == []  # neither the image nor the work tree
