"""Stands in for Firecracker's `jailer` in tests (no jailer binary is installable here).

It parses the jailer's command line, checks what the real jailer checks about it, and does the
part of the jailer's work that decides which paths Firecracker sees: it copies the exec file to
`<chroot_base>/<exec name>/<id>/root/<exec name>`, unshares a mount namespace, makes it a
recursive slave, bind-mounts the chroot onto itself recursively (as the jailer does before its
`pivot_root`) and execs that copy from inside that bind, so every relative path Firecracker is
given resolves inside the jail as the jail's mount namespace has it: a file bind-mounted into the
jail after the jailer started is missing there unless the host's mount propagates, and a mount
the jail makes stays in it. It does not pivot or chroot (the Python stand-in for Firecracker
needs the host's interpreter), so the one absolute path, the API socket, is made relative to the
chroot directory it runs in. The parsed arguments go to
`<chroot_base>/<exec name>/<id>/jailer-args.json` for the test to inspect; uid/gid, cgroups and
rlimits are recorded, not applied. The netns is joined, as the jailer does, so Firecracker finds
its tap there. Except: with `AENV_FAKE_JAILER_CGROUPS` set to a
cgroup v1 root (e.g. `/sys/fs/cgroup`) and `--cgroup-version 1`, it creates the cgroups as the
jailer does, `<root>/<controller>/<parent cgroup>/<id>` with the `--cgroup` values, and joins them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

CLONE_NEWNS = 0x00020000


def main() -> None:
    head, sep, firecracker_args = _split(sys.argv[1:])
    if not sep:
        sys.exit("fake jailer: firecracker arguments must follow '--'")
    parser = argparse.ArgumentParser(prog="jailer")
    parser.add_argument("--id", required=True)
    parser.add_argument("--exec-file", required=True)
    parser.add_argument("--uid", type=int, required=True)
    parser.add_argument("--gid", type=int, required=True)
    parser.add_argument("--chroot-base-dir", default="/srv/jailer")
    parser.add_argument("--cgroup-version", choices=["1", "2"], default="1")
    parser.add_argument("--parent-cgroup")
    parser.add_argument("--cgroup", action="append", default=[])
    parser.add_argument("--resource-limit", action="append", default=[])
    parser.add_argument("--netns")
    parser.add_argument("--daemonize", action="store_true")
    parser.add_argument("--new-pid-ns", action="store_true")
    args = parser.parse_args(head)
    if len(args.id) > 64 or not all(c.isalnum() or c == "-" for c in args.id):
        sys.exit(f"jailer: invalid id {args.id!r}")
    for item in args.cgroup + args.resource_limit:
        if "=" not in item:
            sys.exit(f"jailer: expected key=value, got {item!r}")
    if args.netns and not Path(args.netns).exists():
        sys.exit(f"jailer: netns {args.netns} does not exist")

    exec_file = Path(args.exec_file)
    instance = Path(args.chroot_base_dir) / exec_file.name / args.id
    root = instance / "root"
    root.mkdir(parents=True, exist_ok=True)
    jailed = root / exec_file.name
    shutil.copy2(exec_file, jailed)
    (instance / "jailer-args.json").write_text(
        json.dumps({**vars(args), "firecracker_args": firecracker_args})
    )
    rebased = []
    for i, arg in enumerate(firecracker_args):
        previous = firecracker_args[i - 1] if i else ""
        rebased.append(arg.lstrip("/") if previous == "--api-sock" else arg)
    cgroup_root = os.environ.get("AENV_FAKE_JAILER_CGROUPS")
    if cgroup_root and args.cgroup_version == "1":
        _join_cgroups(Path(cgroup_root), args.parent_cgroup or exec_file.name, args.id, args.cgroup)
    _enter_jail_mounts(root)
    argv = [str(jailed), "--id", args.id, *rebased]
    if args.netns:
        nsenter = shutil.which("nsenter") or "nsenter"
        argv = [nsenter, f"--net={args.netns}", "--", *argv]
    os.execv(argv[0], argv)


def _enter_jail_mounts(root: Path) -> None:
    if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNS) != 0:
        sys.exit(f"jailer: unshare: {os.strerror(ctypes.get_errno())}")
    subprocess.run(["mount", "--make-rslave", "/"], check=True)
    subprocess.run(["mount", "--rbind", str(root), str(root)], check=True)
    # Into the bind just made: the directory opened before it is the one underneath.
    os.chdir("/")
    os.chdir(root)


def _join_cgroups(root: Path, parent: str, vm_id: str, settings: list[str]) -> None:
    groups: set[Path] = set()
    for item in settings:
        name, value = item.split("=", 1)
        group = root / name.split(".", 1)[0] / parent / vm_id
        group.mkdir(parents=True, exist_ok=True)
        (group / name).write_text(value)
        groups.add(group)
    for group in groups:
        (group / "cgroup.procs").write_text(str(os.getpid()))


def _split(argv: list[str]) -> tuple[list[str], bool, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], True, argv[i + 1 :]
    return argv, False, []


if __name__ == "__main__":
    main()
