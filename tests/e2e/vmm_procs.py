"""Find a sandbox's VMM processes from inside the server's namespace: their command lines name
the sandbox's work directory (`$AENV_HOME/sandboxes/<id>/...`)."""

from __future__ import annotations

from pathlib import Path


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
