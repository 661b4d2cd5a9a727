"""Whether a VMM process is jailed, read from /proc as the host sees it: its credentials,
capabilities, no_new_privs and seccomp mode, its cgroups and namespaces, and the files its root
shows."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

SYSTEM = Path("/usr")  # read-only system files every jail shows
LINKS = {"bin", "sbin", "lib", "lib32", "lib64", "libx32"}  # usrmerge links to /usr
PROC = Path("/proc")


def status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def visible_files(pid: int) -> list[Path]:
    """Every non-directory the process's root shows, as paths inside it, except /usr's and
    /proc's."""
    root = Path(f"/proc/{pid}/root")
    found = []
    for directory, dirs, files in os.walk(root):
        inside = Path("/") / Path(directory).relative_to(root)
        if inside in (SYSTEM, PROC):
            dirs.clear()
            continue
        found += [inside / name for name in files]
        found += [inside / d for d in dirs if (Path(directory) / d).is_symlink()]
    return found


def _cgroups(pid: int) -> dict[str, str]:
    """Controller (v1; '' for the v2 hierarchy) -> cgroup path of `pid`."""
    found = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            found[controller] = path
    return found


def jail_problems(pid: int, allowed: Sequence[Path], *, shares: bool = False) -> list[str]:
    """What makes `pid` not jailed; its root may show files under `allowed` (and /usr, /dev).
    A VMM that serves `shares` has a /proc, which must show its own processes alone."""
    st = status(pid)
    problems = []
    if "0" in st["Uid"].split() or "0" in st["Gid"].split():
        problems.append(f"runs as uid/gid {st['Uid']} / {st['Gid']}")
    if int(st["CapEff"], 16) or int(st["CapPrm"], 16):
        problems.append(f"has capabilities {st['CapEff']}")
    if st["NoNewPrivs"] != "1":
        problems.append("no_new_privs is off")
    if st["Seccomp"] != "2":
        problems.append(f"seccomp mode {st['Seccomp']}")
    own, its = _cgroups(os.getpid()), _cgroups(pid)
    # cgroup v1 hosts limit through these controllers, v2 hosts through the unified hierarchy.
    for controller in ("memory", "pids", "cpu") if "memory" in own else ("",):
        if its.get(controller) == own.get(controller):
            problems.append(f"shares this process's {controller or 'v2'} cgroup")
    for ns in ("mnt", "net", "ipc"):
        if os.readlink(f"/proc/{pid}/ns/{ns}") == os.readlink(f"/proc/self/ns/{ns}"):
            problems.append(f"shares the host's {ns} namespace")
    root = Path(f"/proc/{pid}/root")
    if (root / "etc").exists() or (root / "root").exists():
        problems.append("its root shows /etc or /root")
    if (root / "proc").exists() and not shares:
        problems.append("its root shows /proc")
    if shares and not {"hidepid=invisible", "subset=pid"} <= (options := _proc_options(pid)):
        problems.append(f"its /proc is mounted with {sorted(options)}")
    for path in visible_files(pid):
        ok = [Path("/dev"), *allowed]
        if not any(path.is_relative_to(a) for a in ok) and str(path)[1:] not in LINKS:
            problems.append(f"its root shows {path}")
    return problems


def _proc_options(pid: int) -> set[str]:
    """The mount and superblock options of the /proc in `pid`'s root (hidepid=invisible shows
    a process only to its own uid; subset=pid hides the system files)."""
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields, _, after = line.partition(" - ")
        if fields.split()[4] == "/proc" and after.split()[0] == "proc":
            return {*fields.split()[5].split(","), *after.split()[2].split(",")}
    return set()
