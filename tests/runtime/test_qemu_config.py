"""Pure parts of the QEMU driver: host TSC frequency, option escaping."""

from __future__ import annotations

import pytest

from aenv.runtime.driver import DriverError
from aenv.runtime.qemu import host_tsc_khz
from aenv.runtime.qemu.cmdline import opt


def test_tsc_from_cpuinfo() -> None:
    assert host_tsc_khz("processor\t: 0\ncpu MHz\t\t: 2445.404\n") == 2445404


def test_tsc_missing() -> None:
    with pytest.raises(DriverError):
        host_tsc_khz("processor\t: 0\n")


def test_option_values_escape_commas() -> None:
    assert opt("/tmp/a,b") == "/tmp/a,,b"
