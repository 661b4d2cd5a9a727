"""Starts a jailed, paused QEMU named argv[1] of the node whose data directory is argv[2], prints
its pid and exits without waiting for it (test_jail_unit's orphan)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from aenv.runtime.jail import SECCOMP, Jail, host_binary


async def main(name: str, home: str) -> None:
    jail = Jail(uid=2_000_000 + 65_535, gid=2_000_000)
    async with jail.assemble([]) as prefix:
        proc = subprocess.Popen(
            [*prefix, str(host_binary("qemu-system-x86_64")), "-M", "microvm", "-S",
             "-display", "none", "-nodefaults", "-name", name, "-sandbox", SECCOMP,
             # A node's VMMs name files under its data directory, which is how its sweep knows
             # them; an inline secret names one without the jail having to show it.
             "-object", f"secret,id=home,data={home}/disk"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        # Jailed once QEMU, not nsenter or setpriv, runs with the seccomp filter on.
        while "Seccomp:\t2" not in Path(f"/proc/{proc.pid}/status").read_text():
            await asyncio.sleep(0.01)
    print(proc.pid)


asyncio.run(main(sys.argv[1], sys.argv[2]))
