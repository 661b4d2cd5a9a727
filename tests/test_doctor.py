"""`aenv doctor` as a user runs it: one line a check, exit 1 when one fails. Its resolver and
Redis are real servers on loopback (a DNS server answering every name, a redis-server), so a
check passes only when the thing it checks answers, and fails when it does not."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import dns.message
import dns.rrset
import pytest

from aenv import claims
from aenv.config import load
from tests.support.ports import free_port
from tests.support.redis_server import redis_server

# A loopback address of its own: nothing else on the host listens there on port 53.
RESOLVER = "127.0.0.77"
SILENT = "127.0.0.78"
ANSWER = "192.0.2.10"


@pytest.fixture
def resolver() -> Iterator[str]:
    """A DNS server answering every A query with `ANSWER`, until the test ends."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((RESOLVER, 53))
    sock.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                data, peer = sock.recvfrom(4096)
            except TimeoutError:
                continue
            query = dns.message.from_wire(data)
            reply = dns.message.make_response(query)
            name = query.question[0].name
            reply.answer.append(dns.rrset.from_text(name, 60, "IN", "A", ANSWER))
            sock.sendto(reply.to_wire(), peer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield RESOLVER
    finally:
        done.set()
        thread.join()
        sock.close()


def doctor(home: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "AENV_HOME": str(home),
        # Configured: the KVM probe would fetch the guest kernel first.
        "AENV_DRIVER": "qemu-tcg",
        "AENV_BUILD_EGRESS": "pypi.org,registry.npmjs.org",
        "AENV_DEBIAN_MIRROR": "http://deb.debian.org/debian",
        # Never the host's own resolver: tests send traffic to loopback only.
        "AENV_NETWORK_DNS": SILENT,
        **settings,
    }
    return subprocess.run(
        [sys.executable, "-m", "aenv.cli", "doctor"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _line(output: str, name: str) -> str:
    return next(line for line in output.splitlines() if line.split()[1:2] == [name])


def test_every_check_passes_on_a_host_that_can_run_a_node(tmp_path: Path, resolver: str) -> None:
    with redis_server(tmp_path) as redis:
        done = doctor(tmp_path / "home", AENV_NETWORK_DNS=resolver, AENV_REDIS_URL=redis.url)
    assert done.returncode == 0, done.stdout + done.stderr
    dns_line = _line(done.stdout, "dns")
    assert dns_line.startswith("pass") and "pypi.org" in dns_line and "deb.debian.org" in dns_line
    assert _line(done.stdout, "redis").startswith("pass")
    assert _line(done.stdout, "vmm").startswith("pass")
    assert _line(done.stdout, "disk").startswith("pass")


def test_a_resolver_that_does_not_answer_and_a_redis_that_is_gone_fail(tmp_path: Path) -> None:
    done = doctor(
        tmp_path / "home",
        AENV_NETWORK_DNS=SILENT,
        AENV_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0",
        AENV_RESERVE_DISK_MB=str(1 << 40),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    dns_line = _line(done.stdout, "dns")
    assert dns_line.startswith("FAIL") and "set network_dns" in dns_line
    assert _line(done.stdout, "redis").startswith("FAIL")
    assert _line(done.stdout, "disk").startswith("FAIL")
    # The others still ran.
    assert _line(done.stdout, "memory").startswith("pass")


def test_a_prefix_another_running_node_holds_fails(tmp_path: Path) -> None:
    prefix = f"aenvdr{secrets.token_hex(2)}"
    held = claims.claim(load({"home": tmp_path / "other", "network_prefix": prefix}))
    try:
        clash = doctor(tmp_path / "home", AENV_NETWORK_PREFIX=prefix)
        free = doctor(tmp_path / "home")
    finally:
        held.release()
    line = _line(clash.stdout, "claims")
    assert clash.returncode == 1 and line.startswith("FAIL"), clash.stdout
    assert f"network_prefix {prefix!r} is held" in line and str(tmp_path / "other") in line
    assert _line(free.stdout, "claims").startswith("pass"), free.stdout
