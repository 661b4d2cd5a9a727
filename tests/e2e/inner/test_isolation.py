"""Isolation from inside a guest (issue 14): as `user` and as root, a sandbox reaches none of
the node's control plane (the API port, on every address the node has), no other sandbox's envd
(at its slot address, where the node reaches it), no metadata-style address and no service
listening on the node; the same probe does reach the guest's own envd, so it can fail.

The VMM's view (its uid, capabilities, seccomp and mount namespace) is checked by
test_jail.py; the internal ranges under permissive egress rules by network/test_egress.py.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import threading
from collections.abc import Iterator

import pytest
from e2b import Sandbox

API_PORT = 3000
ENVD_PORT = 49983
# Long enough for a connect across the node, short enough for a dropped SYN not to drag.
PROBE_SECONDS = 3


def _node_addresses() -> list[str]:
    """Every IPv4 address of the node's namespace: the host ends of the slots' veths and lo."""
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout
    return [line.split()[3].split("/")[0] for line in out.splitlines()]


def _slot_addresses() -> list[str]:
    """The namespace end of every slot's /30 (the host end plus one): where envds are reached."""
    return [
        str(ipaddress.IPv4Address(a) + 1) for a in _node_addresses() if not a.startswith("127.")
    ]


def _open(sandbox: Sandbox, targets: list[tuple[str, int]], user: str) -> set[tuple[str, int]]:
    """The (address, port) pairs a TCP connect from inside the guest succeeds to, as `user`."""
    probes = [
        f"timeout {PROBE_SECONDS} bash -c 'echo > /dev/tcp/{a}/{p}' 2>/dev/null && echo {a}:{p};"
        for a, p in targets
    ]
    script = " ".join([*probes, "true"])
    out = sandbox.commands.run(script, user=user, timeout=len(targets) * PROBE_SECONDS + 30)
    opened = set()
    for line in out.stdout.split():
        address, port = line.rsplit(":", 1)
        opened.add((address, int(port)))
    return opened


@pytest.fixture(scope="module")
def listener() -> Iterator[int]:
    """A TCP service on every address of the node (as a redis or an S3 test server would be)."""
    server = socket.create_server(("0.0.0.0", 0))
    port: int = server.getsockname()[1]

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    yield port
    server.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Sandbox, Sandbox]]:
    a, b = Sandbox.create(timeout=300), Sandbox.create(timeout=300)
    yield a, b
    a.kill()
    b.kill()


@pytest.mark.parametrize("user", ["user", "root"])
def test_guest_reaches_nothing_of_the_node(
    pair: tuple[Sandbox, Sandbox], listener: int, user: str
) -> None:
    guest, _ = pair
    node = _node_addresses()
    # The node's service is really there: from the node itself it answers.
    with socket.create_connection((node[-1], listener), timeout=PROBE_SECONDS):
        pass
    targets = [
        *[(a, port) for a in node for port in (API_PORT, listener)],
        *[(a, ENVD_PORT) for a in _slot_addresses()],
        ("10.0.2.2", API_PORT),  # the guest's gateway (the tap)
        ("10.0.2.2", listener),
        ("169.254.169.254", 80),
        ("169.254.169.254", 443),
    ]
    assert _open(guest, [("127.0.0.1", ENVD_PORT), *targets], user) == {("127.0.0.1", ENVD_PORT)}


@pytest.mark.parametrize("user", ["user", "root"])
def test_other_sandbox_is_out_of_reach(pair: tuple[Sandbox, Sandbox], user: str) -> None:
    a, b = pair
    # Every guest has the same address in its own slot: B's own view of itself answers, and
    # neither that address nor any slot address answers from A.
    own = b.commands.run("hostname -I", user=user).stdout.split()
    assert own, "the guest reported no address"
    assert (own[0], ENVD_PORT) in _open(b, [(own[0], ENVD_PORT)], user)
    reached = _open(a, [(s, ENVD_PORT) for s in _slot_addresses()], user)
    assert reached == set()
