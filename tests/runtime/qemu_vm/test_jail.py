"""The jail of a real QEMU: exactly its own files in view, what its uid can do with them from
inside, and a snapshot that keeps running (a file added to a live jail). Every other test's
VMMs are checked by the fixtures (`Places.check_jailed`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from aenv.runtime import qcow2
from aenv.runtime.driver import Snapshot
from aenv.runtime.qemu import QemuVM
from tests.runtime.qemu_vm.conftest import TEMPLATE_NOTE, Fleet, Places, Template
from tests.runtime.qemu_vm.netns import agent
from tests.support.jail import LINKS, status, visible_files

pytestmark = pytest.mark.slow

# Runs inside a VMM's jail, as its uid: what each path allows (errors by name).
PROBE = r"""
import json, os, sys
def try_(fn):
    try:
        fn(); return "ok"
    except OSError as e:
        return type(e).__name__
paths, pid = json.loads(sys.argv[1]), int(sys.argv[2])
out = {p: {"read": try_(lambda: open(p, "rb").close()),
           "write": try_(lambda: open(p, "r+b").close())} for p in paths}
out["signal"] = try_(lambda: os.kill(pid, 0))
out["socket"] = try_(lambda: __import__("socket").create_connection(("127.0.0.1", 22), 1))
print(json.dumps(out))
"""


def probe_inside(vm: QemuVM, paths: list[Path], other_pid: int) -> dict[str, object]:
    st = status(vm.proc.pid)
    uid, gid = st["Uid"].split()[0], st["Gid"].split()[0]
    out = subprocess.run(
        ["nsenter", f"--target={vm.proc.pid}", "--mount", "--net", "--ipc", "--",
         "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--",
         "/usr/bin/python3", "-c", PROBE, json.dumps([str(p) for p in paths]), str(other_pid)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    result: dict[str, object] = json.loads(out)
    return result


def own_files(vm: QemuVM, snapshot: Snapshot) -> dict[str, set[Path]]:
    spec = vm.spec
    top = next(d.path for d in spec.disks if not d.read_only)
    read = {p for p in (spec.kernel, spec.initrd) if p}
    for disk in spec.disks:
        read |= set(qcow2.chain(disk.path)) - {top}
    work = spec.workdir
    own = {top, *work.glob("qmp.*.sock"), *work.glob("console.*.log")}
    assert snapshot.memory_file is not None
    return {"read": read, "own": own, "shared": {snapshot.memory_file}}


async def test_a_restored_vmm_sees_and_reaches_only_its_own_files(
    fleet: Fleet, template: Template
) -> None:
    (vm, netns), (other, _) = await fleet.restore_many(template.snapshot, 2)
    assert isinstance(vm, QemuVM) and isinstance(other, QemuVM)
    assert (await agent(netns))["note"] == TEMPLATE_NOTE
    files = own_files(vm, template.snapshot)
    devices = {Path("/dev") / d for d in ("null", "zero", "full", "random", "urandom")}
    links = {Path("/") / n for n in LINKS if (Path("/") / n).is_symlink()}
    assert set(visible_files(vm.proc.pid)) == set().union(*files.values()) | devices | links
    assert status(vm.proc.pid)["Uid"] != status(other.proc.pid)["Uid"]
    others = [Path("/etc/shadow"), other.console_log, template.snapshot.state_file]
    usable = [Path("/dev/null"), Path("/dev/urandom")]
    seen = probe_inside(
        vm, [*files["read"], *files["own"], *files["shared"], *others, *usable], other.proc.pid
    )
    for path in files["read"]:
        # Not writable: by mode (PermissionError) and by mount (OSError: EROFS).
        assert seen[str(path)] == {"read": "ok", "write": "PermissionError"}, path
    for path in files["own"] - {p for p in files["own"] if p.suffix == ".sock"}:
        assert seen[str(path)] == {"read": "ok", "write": "ok"}, path
    for path in usable:
        assert seen[str(path)] == {"read": "ok", "write": "ok"}, path  # devices work in the jail
    for path in others:
        assert seen[str(path)] == {"read": "FileNotFoundError", "write": "FileNotFoundError"}
    assert seen["signal"] == "PermissionError"  # another VMM's process: another uid
    assert seen["socket"] in ("OSError", "ConnectionRefusedError")  # its own empty network


async def test_a_snapshot_that_keeps_running_adds_its_new_top_to_the_jail(
    fleet: Fleet, template: Template, places: Places
) -> None:
    vm, netns = await fleet.restore(template.snapshot)
    assert isinstance(vm, QemuVM)
    await agent(netns, "POST", "/?memory=m1&note=after-restack")
    await vm.snapshot(places.snapshot_target(), keep_running=True)
    top = next(d.path for d in vm.spec.disks if not d.read_only)
    assert top in visible_files(vm.proc.pid)
    await agent(netns, "POST", "/?memory=m2&note=on-the-new-top")  # written through the added file
    assert (await agent(netns))["note"] == "on-the-new-top"
    assert top.stat().st_uid == int(status(vm.proc.pid)["Uid"].split()[0])
