"""Find a sandbox's VMM processes from inside the server's namespace: their command lines name
the sandbox's work directory (`$AENV_HOME/sandboxes/<id>/...`)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import psutil

from aenv.runtime.sweep import VMM_NAME_PREFIX, our_vmms, vmm_identity

# Set by `ServerNs.run` for the suites it runs: the running server's pid.
SERVER_PID = "AENV_E2E_SERVER_PID"


def _cmdlines() -> Iterator[tuple[int, bytes]]:
    """(pid, raw command line) of every process still there when read."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                yield int(entry.name), (entry / "cmdline").read_bytes()
            except OSError:
                continue


def vmm_pids(sandbox_id: str) -> list[int]:
    marker = f"/sandboxes/{sandbox_id}/".encode()
    return [pid for pid, cmdline in _cmdlines() if marker in cmdline]


def _naming_sandboxes(home: Path) -> Iterator[tuple[int, list[str], set[str]]]:
    """(pid, command line, the sandboxes whose files it names) of every process naming some."""
    marker = re.compile(re.escape(f"{home}/sandboxes/").encode() + rb"([^/\x00]+)/")
    for pid, cmdline in _cmdlines():
        ids = {m.group(1).decode() for m in marker.finditer(cmdline)}
        if ids:
            argv = [a.decode(errors="replace") for a in cmdline.split(b"\x00") if a]
            yield pid, argv, ids


def vmm_sandbox_ids(home: Path) -> set[str]:
    """The sandboxes of the node at `home` that a VMM still runs for."""
    found: set[str] = set()
    for _pid, argv, ids in _naming_sandboxes(home):
        if vmm_identity(argv, VMM_NAME_PREFIX) is not None:
            found |= ids
    return found


def strays(home: Path) -> dict[str, list[str]]:
    """{sandbox id: the processes naming its files} that the running server (`SERVER_PID`) did
    not start: a VMM or a tool a killed server left. The server's own tools (the upload of a
    paused sandbox's checkpoint copying its disk) are not."""
    server = psutil.Process(int(os.environ[SERVER_PID]))
    ours = {server.pid} | {child.pid for child in server.children(recursive=True)}
    found: dict[str, list[str]] = {}
    for pid, argv, ids in _naming_sandboxes(home):
        if pid not in ours:
            for sandbox_id in ids:
                found.setdefault(sandbox_id, []).append(f"{pid}: {' '.join(argv)[:400]}")
    return found


def node_vmm_pids(home: Path) -> list[int]:
    """Every VMM of the node at `home` (its command line names the node's files)."""
    marker = f"{home}/".encode()
    pids = []
    for vmm in our_vmms():
        try:
            if marker in Path(f"/proc/{vmm.pid}/cmdline").read_bytes():
                pids.append(vmm.pid)
        except OSError:
            continue  # gone meanwhile
    return pids
