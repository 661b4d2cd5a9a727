"""The process the sweep test kills: it boots Firecracker VMs through the driver (unjailed, a clone
restored from a snapshot, and one through `fake_jailer.py` whose writable layer is on another
filesystem, `jailed_layers` in the plan), prints their ids and pids as one JSON
line, and waits to be killed. Run as `python -m tests.runtime.firecracker.sweep_child PLAN`, where
PLAN is the JSON the test writes (paths, names and the stand-in binaries)."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path

from aenv.runtime import driver as d
from aenv.runtime.firecracker import FirecrackerConfig, FirecrackerDriver
from aenv.runtime.firecracker.jailer import JailerConfig
from aenv.runtime.firecracker.vm import FirecrackerVM


def _spec(root: Path, workdir: Path, net: d.NetAttachment, layers: Path) -> d.VMSpec:
    images = root / "images"
    return d.VMSpec(
        vcpus=1,
        memory_mib=4,
        kernel=images / "vmlinux",
        initrd=images / "initrd",
        cmdline="console=ttyS0",
        workdir=workdir,
        disks=(
            d.Disk("base", images / "base.ext4", read_only=True),
            d.Disk("upper", layers / "upper.img"),
        ),
        net=net,
    )


async def main(plan: dict[str, str]) -> None:
    root = Path(plan["root"])
    config = FirecrackerConfig(
        binary=Path(plan["firecracker"]),
        cgroup_parent=plan["cgroup_parent"],
        id_prefix=plan["id_prefix"],
        ready_timeout_s=30,
    )
    jailed = replace(
        config,
        jailer=JailerConfig(
            binary=Path(plan["jailer"]),
            uid=12345,
            gid=23456,
            chroot_base_dir=root / "jails",
            cgroup_version=1,
            parent_cgroup=plan["jail_cgroup_parent"],
        ),
    )
    net = d.NetAttachment(netns=plan["netns"], tap="tap0", mac="02:fc:00:00:00:01")
    direct = FirecrackerDriver(config)
    source = await direct.boot(_spec(root, root / "source", net, root / "source"))
    snapshot = await source.snapshot(
        d.SnapshotTarget(directory=root / "snap", memory_dir=root / "mem"), keep_running=True
    )
    clone = await direct.restore(snapshot, d.RestoreSpec(workdir=root / "clone", net=net))
    # Its writable layer on another filesystem than the jail: bind-mounted in.
    layers = Path(plan["jailed_layers"])
    inside = await FirecrackerDriver(jailed).boot(_spec(root, root / "jailed", net, layers))
    vms = {}
    for vm in (source, clone, inside):
        assert isinstance(vm, FirecrackerVM) and vm.process is not None
        vms[vm.id] = vm.process.pid
    print(json.dumps(vms), flush=True)
    await asyncio.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
