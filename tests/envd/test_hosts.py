"""The guest's hostname in its hosts file (envd/hosts.py), on a file in a temp dir: `/init`
itself renames the host, so the envd suites do not send a hostname (see test_init.py); the
guest's own file is checked in tests/e2e/inner/test_guest_identity.py."""

from __future__ import annotations

import stat
from pathlib import Path

from aenv.envd.hosts import LOCALHOST, set_hostname


def test_a_renamed_guest_has_its_new_name_alone(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.1.1 sandbox\n10.0.0.5 registry # kept\n")
    set_hostname("sbx-one", hosts)
    set_hostname("sbx-two", hosts)  # a fork or resume renames it
    assert hosts.read_text() == (
        "127.0.0.1 localhost\n10.0.0.5 registry # kept\n127.0.1.1\tsbx-two\n"
    )
    assert stat.S_IMODE(hosts.stat().st_mode) == 0o644  # every user resolves names


def test_a_missing_hosts_file_gets_localhost_too(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    set_hostname("sbx", hosts)
    assert hosts.read_text() == LOCALHOST + "127.0.1.1\tsbx\n"
    before = hosts.stat().st_ino
    set_hostname("sbx", hosts)  # already right: not rewritten
    assert hosts.stat().st_ino == before
