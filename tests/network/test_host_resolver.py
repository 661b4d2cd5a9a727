"""The node's resolver by default: the host's first IPv4 nameserver (it is asked from the host
namespace, so one on loopback serves)."""

from __future__ import annotations

from ipaddress import IPv4Address
from pathlib import Path

from aenv.network.dns import FALLBACK_RESOLVER, host_resolver


def test_first_ipv4_nameserver(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text(
        "# comment\nsearch example\nnameserver ::1\nnameserver fe80::1\nnameserver bogus\n"
        "nameserver 10.255.255.53\nnameserver 9.9.9.9\n"
    )
    assert host_resolver(conf) == IPv4Address("10.255.255.53")
    conf.write_text("nameserver 127.0.0.53\nnameserver 9.9.9.9\n")  # systemd-resolved's stub
    assert host_resolver(conf) == IPv4Address("127.0.0.53")


def test_fallback_without_a_usable_nameserver(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver ::1\n")
    assert host_resolver(conf) == FALLBACK_RESOLVER
    assert host_resolver(tmp_path / "missing") == FALLBACK_RESOLVER
