"""The volume content API against a volume a real guest mounts, with the unmodified Python SDK:
files, owners and modes cross between the API and the guest both ways; what a hostile guest
plants (symlinks to host files, a hard link, a FIFO, a device node) is listed and refused, and
the host files it names stay untouched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from e2b import Sandbox, Volume, VolumeException
from e2b.volume.types import VolumeFileType

from tests.e2e.inner.conftest import BASE, LIFETIME

_PLANT = """set -e
cd /mnt/v
echo mine > plain
echo shared > linked
ln linked hard
ln -s /etc/hostname link
ln -s / rootlink
mkfifo fifo
mknod null c 1 3
touch owned && chown 1234:99 owned && chmod 640 owned
"""


@pytest.fixture(autouse=True)
def _volume_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("E2B_VOLUME_API_URL", BASE)


def test_a_guest_and_the_api_share_files_and_hostile_entries_are_refused() -> None:
    volume = Volume.create("hostile")
    sandbox = Sandbox.create(timeout=LIFETIME, volume_mounts={"/mnt/v": volume})
    host_name = Path("/etc/hostname").read_bytes()
    try:
        volume.make_dir("/made", uid=1000, gid=1000, mode=0o750)
        volume.write_file("/made/from-api", "written by the API", mode=0o600, uid=1000)
        seen = sandbox.commands.run("stat -c '%u %g %a' /mnt/v/made /mnt/v/made/from-api")
        assert seen.stdout.split("\n")[:2] == ["1000 1000 750", "1000 0 600"]
        assert sandbox.files.read("/mnt/v/made/from-api") == "written by the API"

        sandbox.commands.run(_PLANT, user="root")
        assert volume.read_file("/plain") == "mine\n"
        owned = volume.get_info("/owned")
        assert (owned.uid, owned.gid, owned.mode, owned.type) == (1234, 99, 0o640, "file")
        entries = {e.name: e for e in volume.list("/")}
        assert entries["link"].type == VolumeFileType.SYMLINK
        assert entries["link"].target == "/etc/hostname"
        assert entries["rootlink"].target == "/"
        assert entries["fifo"].type == entries["null"].type == VolumeFileType.UNKNOWN
        for path in ("/link", "/rootlink/etc/hostname", "/hard", "/linked", "/fifo", "/null"):
            with pytest.raises(VolumeException):
                volume.read_file(path)
            with pytest.raises(VolumeException):
                volume.write_file(path, "overwritten")
            with pytest.raises(VolumeException):
                volume.update_metadata(path, mode=0o777)
        with pytest.raises(VolumeException):
            volume.write_file("/rootlink/tmp/aenv-pwned", "x", force=True)
        with pytest.raises(VolumeException):
            volume.list("/rootlink/etc")
        assert Path("/etc/hostname").read_bytes() == host_name
        assert not os.path.exists("/tmp/aenv-pwned")
        guest = sandbox.commands.run("cat /mnt/v/linked /mnt/v/hard; readlink /mnt/v/link")
        assert guest.stdout == "shared\nshared\n/etc/hostname\n"

        volume.remove("/link")
        volume.remove("/made")
        assert sandbox.commands.run("ls /mnt/v").stdout.split() == [
            "fifo", "hard", "linked", "null", "owned", "plain", "rootlink",
        ]  # fmt: skip
    finally:
        sandbox.kill()
    assert Volume.destroy(volume.volume_id) is True
