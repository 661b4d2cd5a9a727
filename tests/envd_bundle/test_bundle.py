"""The envd bundle serves the e2b SDK from roots without Python: Debian minbase (glibc, no python3)
and busybox alone (no libc), mounted read-only at /opt/aenv as in a guest, inside a throwaway root
(fresh mount + PID namespaces, so nothing leaks to the host)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv.envd_bundle import PREFIX
from tests.support.envd_process import serve_in_throwaway_root
from tests.support.guest import envd_bundle
from tests.support.ports import free_port
from tests.support.rootfs import busybox_root, debian_minbase

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def bundle() -> Path:
    return envd_bundle()


@pytest.fixture(params=["debian-minbase", "busybox"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if request.param == "busybox":
        return busybox_root(tmp_path / "root")
    return debian_minbase()


@pytest.fixture
def url(bundle: Path, root: Path) -> Iterator[str]:
    port = free_port()
    envd = [f"{PREFIX}/aenv-envd", "--host", "127.0.0.1", "--port", str(port)]
    options = ["--lower", str(root), "--ro-bind", str(bundle), PREFIX]
    with serve_in_throwaway_root(envd, port, harness_options=options) as url:
        yield url


def test_root_has_no_python(root: Path) -> None:
    pythons = [*root.glob("usr/bin/python*"), *root.glob("usr/lib/python3*"), *root.glob("bin/py*")]
    assert pythons == []
    assert list(root.rglob("libpython*")) == []


def test_bundle_serves_the_sdk(url: str) -> None:
    assert httpx.get(f"{url}/health").status_code == 204
    sbx = Sandbox.create(debug=True, sandbox_url=url)

    assert sbx.commands.run("id -un; id -u").stdout.split() == ["user", "1000"]
    assert sbx.commands.run("id -un", user="root").stdout.strip() == "root"
    # python3 is really absent for the commands envd runs, not only from the tree on disk.
    probe = sbx.commands.run("command -v python3 python || echo none")
    assert probe.stdout.strip() == "none"

    sbx.files.write("/home/user/hello.txt", "hello from the bundle\n")
    assert sbx.files.read("/home/user/hello.txt") == "hello from the bundle\n"
    assert sbx.commands.run("stat -c %u /home/user/hello.txt").stdout.strip() == "1000"
    sbx.files.write("/root/secret", b"\x00\x01", user="root")
    assert sbx.files.read("/root/secret", format="bytes", user="root") == b"\x00\x01"

    # Children get the guest's libraries, not the bundle's glibc (see aenv/envd_bundle/rthook.py).
    env = sbx.commands.run("env").stdout
    assert "LD_LIBRARY_PATH" not in env
    assert PREFIX not in env
    # The bundle runs from a read-only mount, as in a guest.
    mounts = sbx.commands.run("cat /proc/mounts").stdout.splitlines()
    opts = next(line.split()[3] for line in mounts if line.split()[1] == PREFIX)
    assert opts.split(",")[0] == "ro"
