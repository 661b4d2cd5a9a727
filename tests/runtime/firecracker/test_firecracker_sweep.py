"""The startup sweep after a server that ran Firecracker VMs was killed with SIGKILL: a child
process boots VMs through the driver (`sweep_child.py`: unjailed, a restored clone, one through
the jailer stand-in, which makes real v1 cgroups here as the jailer would), the test kills it, and
`aenv.runtime.sweep` must leave no process, cgroup, jail or driver file behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from aenv.mounts import mounts_under
from aenv.runtime.cgroups import CGROUP_ROOT, CgroupManager, detect
from aenv.runtime.firecracker import FirecrackerConfig, FirecrackerDriver
from aenv.runtime.firecracker.jailer import JailerConfig
from aenv.runtime.firecracker.leftovers import remove_workdir_leftovers
from aenv.runtime.sweep import sweep, vmm_identity
from tests.runtime.firecracker.conftest import REPO
from tests.runtime.firecracker.fc_support import alive

HERE = Path(__file__).resolve().parent
JAIL_CONTROLLERS = ("memory", "pids", "cpu")


def test_vmm_identity_knows_both_vmms() -> None:
    qemu = ["qemu-system-x86_64", "-M", "microvm", "-name", "aenv-0a1b"]
    assert vmm_identity(qemu, "aenv-") == ("qemu", "aenv-0a1b")
    direct = ["/usr/bin/firecracker", "--api-sock", "api.sock", "--id", "aenv-fc-0a1b"]
    assert vmm_identity(direct, "aenv-") == ("firecracker", "aenv-fc-0a1b")
    jailer = ["jailer", "--id", "aenv-fc-0a1b", "--exec-file", "/x/firecracker", "--"]
    assert vmm_identity([*jailer, "--api-sock", "/api.sock"], "aenv-") == (
        "firecracker",
        "aenv-fc-0a1b",
    )
    netns = ["nsenter", "--net=/run/netns/s1", "--", *direct]
    assert vmm_identity(netns, "aenv-") == ("firecracker", "aenv-fc-0a1b")
    assert (
        vmm_identity(["/usr/bin/firecracker", "--api-sock", "a", "--id", "fc-1"], "aenv-") is None
    )
    assert vmm_identity(["some-tool", "--id", "aenv-fc-1"], "aenv-") is None  # no API socket
    assert vmm_identity(["qemu-system-x86_64", "-name"], "aenv-") is None


def test_workdir_leftovers_are_only_the_drivers_files(tmp_path: Path) -> None:
    workdir = tmp_path / "vm"
    (workdir / "layers").mkdir(parents=True)
    (workdir / "drives").mkdir()
    layer = workdir / "layers" / "upper.img"
    layer.write_bytes(b"private layer of a restored VM")
    base = tmp_path / "base.ext4"
    base.write_bytes(b"shared")
    (workdir / "drives" / "upper").symlink_to(layer)
    (workdir / "drives" / "base").symlink_to(base)
    for name in ("console.log", "firecracker.err", "firecracker.log", "metrics.ndjson"):
        (workdir / name).write_text("log")
    (workdir / "upper.img").write_bytes(b"the caller's own layer")
    removed = remove_workdir_leftovers(workdir)
    assert layer in removed and workdir / "drives" in removed
    assert sorted(p.name for p in workdir.iterdir()) == ["upper.img"]
    assert base.read_bytes() == b"shared"


@pytest.fixture
def jailer_binary(tmp_path: Path) -> Path:
    jailer = tmp_path / "bin" / "jailer"
    jailer.parent.mkdir()
    jailer.write_text(f'#!/bin/sh\nexec {sys.executable} {HERE / "fake_jailer.py"} "$@"\n')
    jailer.chmod(0o755)
    return jailer


def _images(root: Path, jailed_layers: Path) -> None:
    images = root / "images"
    images.mkdir()
    for name, data in (("vmlinux", b"\x7fELF kernel"), ("initrd", b"initrd"), ("base.ext4", b"b")):
        (images / name).write_bytes(data)
        (images / name).chmod(0o644)  # readable by the jailed uid
    for vm in ("source", "jailed"):
        (root / vm).mkdir()
    for layers in (root / "source", jailed_layers):
        with (layers / "upper.img").open("wb") as f:
            f.truncate(1 << 20)
    (root / "clone").mkdir()


def _kill_ours(pids: Iterator[int], tag: str) -> None:
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if any(tag in arg for arg in proc.cmdline()):
                proc.kill()


async def test_sweep_reclaims_firecrackers_a_killed_server_left(
    fake_firecracker: Path, jailer_binary: Path, tmp_path: Path, netns: str, shm_dir: Path
) -> None:
    if not (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory hierarchy on this host (the jailer stand-in needs one)")
    # Not `aenv-*`: every node that starts meanwhile (the other lane of `make test` starts
    # many) sweeps the empty groups of sibling parents named so, and would take this test's
    # groups from the reclaimer it checks.
    tag = f"fcsweep-{secrets.token_hex(3)}"
    root = tmp_path / "run"
    root.mkdir()
    _images(root, shm_dir)
    plan = {
        "jailed_layers": str(shm_dir),
        "root": str(root),
        "firecracker": str(fake_firecracker),
        "jailer": str(jailer_binary),
        "netns": netns,
        "cgroup_parent": f"{tag}-fc",
        "jail_cgroup_parent": f"{tag}-jail",
        "id_prefix": f"{tag}-fc-",
    }
    jailer = JailerConfig(
        binary=jailer_binary,
        uid=12345,
        gid=23456,
        chroot_base_dir=root / "jails",
        cgroup_version=1,
        parent_cgroup=plan["jail_cgroup_parent"],
    )
    # The restarted server's view: the same settings as the killed one.
    restarted = FirecrackerDriver(
        FirecrackerConfig(
            binary=fake_firecracker,
            cgroup_parent=plan["cgroup_parent"],
            id_prefix=plan["id_prefix"],
            jailer=jailer,
        )
    )
    fc_cgroups: CgroupManager = detect(plan["cgroup_parent"])
    env = {**os.environ, "PYTHONPATH": str(REPO), "AENV_FAKE_JAILER_CGROUPS": str(CGROUP_ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.runtime.firecracker.sweep_child", json.dumps(plan)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    vms: dict[str, int] = {}
    try:
        assert child.stdout is not None and child.stderr is not None
        line = await asyncio.to_thread(child.stdout.readline)
        if not line:
            child.wait()
            pytest.fail(f"the child failed: {child.stderr.read().decode(errors='replace')}")
        vms = json.loads(line)
        jailed_id = next(i for i in vms if (root / "jails" / "firecracker" / i).is_dir())
        jail_groups = [
            CGROUP_ROOT / c / plan["jail_cgroup_parent"] / jailed_id for c in JAIL_CONTROLLERS
        ]
        assert all(g.is_dir() for g in jail_groups)
        assert len(fc_cgroups.names()) == 2
        assert (root / "clone" / "layers" / "upper.img").is_file()
        jail_mounts = mounts_under((root / "jails").resolve())
        if os.stat(shm_dir).st_dev != os.stat(root).st_dev:
            assert [p.name for p in jail_mounts] == ["upper"]

        child.kill()  # the server dies without cleaning up anything
        child.wait()
        # Re-parented when the child exited, which its wait above saw: no wait here.
        if any(psutil.Process(pid).ppid() != 1 for pid in vms.values()):
            pytest.skip("orphans are re-parented to a subreaper here, not to init")
        assert all(alive(pid) for pid in vms.values())  # orphans, still holding their VMs

        # Without the node's own cgroup manager (whose sibling sweep would also catch groups
        # named like these here): everything below is the Firecracker reclaimer's work.
        fc_groups = set(fc_cgroups.names())
        report = await sweep(None, prefix=tag, home=root, reclaimers=[restarted])

        assert sorted(report.killed) == sorted(vms.values())
        assert not any(alive(pid) for pid in vms.values())
        assert fc_cgroups.names() == []
        assert not any(g.exists() for g in jail_groups)
        assert list((root / "jails" / "firecracker").iterdir()) == []
        assert mounts_under(root.resolve()) == []  # unmounted, not deleted through
        assert (shm_dir / "upper.img").stat().st_size == 1 << 20
        # Workdirs hold only what the caller put there; the clone's private layer is gone.
        assert [p.name for p in (root / "source").iterdir()] == ["upper.img"]
        assert list((root / "jailed").iterdir()) == []
        assert list((root / "clone").iterdir()) == []
        assert set(report.leftovers_removed) >= {
            root / "clone" / "layers" / "upper.img",
            *jail_groups,
        }
        assert {p.name for p in report.leftovers_removed} >= fc_groups
        # A second sweep finds nothing.
        again = await sweep(None, prefix=tag, home=root, reclaimers=[restarted])
        assert again.killed == () and again.leftovers_removed == ()
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        child.wait()
        _kill_ours(iter(vms.values()), tag)
        psutil.wait_procs([p for p in map(_process, vms.values()) if p is not None], timeout=10)
        for name in fc_cgroups.names():
            with contextlib.suppress(Exception):
                fc_cgroups.remove_stale(name)
        fc_cgroups.remove_parent()
        for controller in JAIL_CONTROLLERS:
            parent = CGROUP_ROOT / controller / plan["jail_cgroup_parent"]
            for group in parent.glob("*/") if parent.is_dir() else []:
                with contextlib.suppress(OSError):
                    group.rmdir()
            with contextlib.suppress(OSError):
                parent.rmdir()


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
