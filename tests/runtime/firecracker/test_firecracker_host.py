"""Host facts a Firecracker snapshot is tied to, and the process helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.runtime.firecracker import host
from aenv.runtime.firecracker.api import FirecrackerApi, FirecrackerConnectionError
from aenv.runtime.firecracker.process import FirecrackerExited, FirecrackerProcess, direct_argv
from tests.runtime.firecracker.fc_support import children


def test_accelerator_tells_pvm_from_hardware_kvm(tmp_path: Path) -> None:
    (tmp_path / "kvm").mkdir()
    (tmp_path / "kvm_pvm").mkdir()
    assert host.accelerator(tmp_path) == "pvm"
    (tmp_path / "kvm_intel").mkdir()
    assert host.accelerator(tmp_path) == "kvm"


def test_cpu_model() -> None:
    cpuinfo = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) X\n"
    assert host.cpu_model(cpuinfo) == "Intel(R) Xeon(R) X"
    assert host.cpu_model("processor : 0\n") == "unknown"


def test_compat_tag_round_trip_and_mismatches() -> None:
    tag = host.compat_tag("1.17.2")
    assert host.check_compat(tag, "1.17.0") is None  # patch releases share a snapshot format
    reason = host.check_compat(tag, "1.18.0")
    assert reason is not None and "1.18.0" in reason
    other_cpu = tag.rsplit("/", 1)[0] + "/Another CPU"
    assert "CPU" in (host.check_compat(other_cpu, "1.17.2") or "")
    other_accel = tag.replace(f"/{host.accelerator()}/", "/other/")
    assert "under other" in (host.check_compat(other_accel, "1.17.2") or "")
    assert "not a firecracker" in (host.check_compat("qemu-7.2/tcg/max", "1.17.2") or "")


def test_direct_argv_enters_the_netns_and_keeps_the_socket_relative() -> None:
    argv = direct_argv(
        Path("/usr/bin/firecracker"), socket_path=Path("/deep/workdir/api.sock"), vm_id="fc-1"
    )
    assert argv == ["/usr/bin/firecracker", "--api-sock", "api.sock", "--id", "fc-1"]
    wrapped = direct_argv(
        Path("/usr/bin/firecracker"),
        socket_path=Path("/w/api.sock"),
        vm_id="fc-1",
        netns="sbx",
        extra_args=["--level", "Info"],
    )
    assert wrapped[:3] == ["nsenter", "--net=/run/netns/sbx", "--"]
    assert wrapped[-2:] == ["--level", "Info"]
    by_path = direct_argv(Path("fc"), socket_path=Path("s"), vm_id="x", netns="/proc/1/ns/net")
    assert by_path[1] == "--net=/proc/1/ns/net"


async def test_spawn_times_out_when_nothing_serves_the_socket(tmp_path: Path) -> None:
    script = tmp_path / "silent"
    script.write_text("#!/bin/sh\necho starting >&2\nexec sleep 30\n")
    script.chmod(0o755)
    before = children()
    with pytest.raises(FirecrackerExited, match="did not answer in time; stderr: starting"):
        await FirecrackerProcess.spawn(
            [str(script)],
            cwd=tmp_path,
            socket_path=tmp_path / "api.sock",
            stdout_path=tmp_path / "out",
            stderr_path=tmp_path / "err",
            ready_timeout=0.3,
        )
    assert children() == before  # the silent process was killed and reaped


async def test_a_socket_that_refuses_is_a_connection_error(tmp_path: Path) -> None:
    (tmp_path / "api.sock").write_text("not a socket")
    async with FirecrackerApi(tmp_path / "api.sock") as api:
        with pytest.raises(FirecrackerConnectionError):
            await api.version()
