"""`Ksm` against a directory laid out as /sys/kernel/mm/ksm: the node's tuning is written, the
host's is put back on `restore` (with `run` last), and a missing KSM is an error naming it.
The real ksmd is exercised in tests/runtime/qemu_vm/test_ksm.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.runtime.ksm import Ksm, KsmError, KsmSettings, merged_pages

HOST = {"run": "0", "pages_to_scan": "100", "sleep_millisecs": "20", "use_zero_pages": "0"}


def sysfs(tmp_path: Path) -> Path:
    for name, value in {**HOST, "pages_shared": "3", "pages_sharing": "10",
                        "full_scans": "2", "ksm_zero_pages": "5"}.items():  # fmt: skip
        (tmp_path / name).write_text(value + "\n")
    return tmp_path


def values(root: Path) -> dict[str, str]:
    return {name: (root / name).read_text().strip() for name in HOST}


def test_enable_tunes_and_restore_puts_the_host_back(tmp_path: Path) -> None:
    root = sysfs(tmp_path)
    ksm = Ksm(root)
    ksm.enable(KsmSettings(pages_to_scan=1234, sleep_ms=7, use_zero_pages=True))
    assert values(root) == {
        "run": "1", "pages_to_scan": "1234", "sleep_millisecs": "7", "use_zero_pages": "1"
    }  # fmt: skip
    ksm.enable(KsmSettings(pages_to_scan=99))  # a second enable keeps the first remembered
    ksm.restore()
    assert values(root) == HOST
    stats = ksm.stats()
    assert (stats.pages_sharing, stats.zero_pages, stats.saved_bytes) == (10, 5, 15 * 4096)


def test_missing_ksm_is_refused(tmp_path: Path) -> None:
    ksm = Ksm(tmp_path / "absent")
    assert not ksm.available()
    assert not ksm.stats().running
    with pytest.raises(KsmError, match="no KSM"):
        ksm.enable(KsmSettings())


def test_merged_pages_of_a_gone_process_is_zero() -> None:
    assert merged_pages(2**22 + 1) == 0  # above pid_max: no such process
