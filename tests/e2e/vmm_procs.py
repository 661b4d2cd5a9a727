"""Find a sandbox's VMM processes from inside the server's namespace: their command lines name
the sandbox's work directory (`$AENV_HOME/sandboxes/<id>/...`)."""

from __future__ import annotations

import re
from pathlib import Path

from aenv.runtime.sweep import our_vmms


def vmm_pids(sandbox_id: str) -> list[int]:
    marker = f"/sandboxes/{sandbox_id}/".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def vmm_sandbox_ids(home: Path) -> set[str]:
    """The sandboxes of the node at `home` that some process (a VMM) still runs for."""
    marker = re.compile(re.escape(f"{home}/sandboxes/").encode() + rb"([^/\x00]+)/")
    found: set[str] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            found.update(m.group(1).decode() for m in marker.finditer(cmdline))
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
