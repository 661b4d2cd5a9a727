"""Starts a jailed, paused QEMU named argv[1], prints its pid and exits without waiting for it
(test_jail_unit's orphan)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from aenv.runtime.jail import SECCOMP, Jail, host_binary


async def main(name: str) -> None:
    jail = Jail(uid=2_000_000 + 65_535, gid=2_000_000)
    async with jail.assemble([]) as prefix:
        proc = subprocess.Popen(
            [*prefix, str(host_binary("qemu-system-x86_64")), "-M", "microvm", "-S",
             "-display", "none", "-nodefaults", "-name", name, "-sandbox", SECCOMP],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        # Jailed once QEMU, not nsenter or setpriv, runs with the seccomp filter on.
        while "Seccomp:\t2" not in Path(f"/proc/{proc.pid}/status").read_text():
            await asyncio.sleep(0.01)
    print(proc.pid)


asyncio.run(main(sys.argv[1]))
