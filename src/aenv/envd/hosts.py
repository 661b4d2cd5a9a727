"""The guest's own name in its `/etc/hosts`, set with the hostname at every `/init`: without it
`sudo` and anything else resolving the hostname warns or waits ("unable to resolve host").
A sandbox is renamed when it is created, forked or resumed from another's snapshot, so the
entry of the previous name is replaced, never added to."""

from __future__ import annotations

from pathlib import Path

HOSTS = Path("/etc/hosts")
# Debian's address for the machine's own name when it has no fixed address of its own.
SELF = "127.0.1.1"
LOCALHOST = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"


def with_hostname(hosts: str, hostname: str) -> str:
    """`hosts` with `SELF` naming `hostname` alone; every other line is kept as it was."""
    kept = [line for line in hosts.splitlines() if line.split()[:1] != [SELF]]
    return "\n".join([*kept, f"{SELF}\t{hostname}"]) + "\n"


def set_hostname(hostname: str, path: Path = HOSTS) -> None:
    try:
        current = path.read_text()
    except FileNotFoundError:
        current = LOCALHOST
    wanted = with_hostname(current, hostname)
    if wanted != current:
        # Rewritten in place, not by rename: every create and resume pays this inside /init,
        # and under emulation a new file and a rename in the guest's overlay cost ~40 ms more
        # (bench/snapshots.py). Only a guest process reading it at that instant could see it
        # half-written.
        path.write_text(wanted)
