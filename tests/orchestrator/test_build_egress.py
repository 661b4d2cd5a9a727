"""What a build VM's slot is given: the registries (and the Debian mirror's host) by name,
everything else denied; the CA env vars only with a bundle; a node's config read into it."""

from __future__ import annotations

from ipaddress import IPv4Network
from pathlib import Path

from aenv.config import REGISTRIES, load
from aenv.orchestrator.build_egress import GUEST_CA, BuildEgress


def test_registries_and_the_mirror_by_name_everything_else_denied() -> None:
    egress = BuildEgress.for_node(("pypi.org",), None, "http://mirror.example:8080/debian")
    assert egress.hosts == ("pypi.org", "mirror.example")
    slot = egress.network().egress
    assert slot.enabled
    assert slot.policy.domains == ("mirror.example", "pypi.org")
    assert slot.policy.allow == ()
    assert slot.policy.deny == (IPv4Network("0.0.0.0/0"),)


def test_a_mirror_already_listed_is_listed_once() -> None:
    egress = BuildEgress.for_node(REGISTRIES, None, "http://deb.debian.org/debian")
    assert egress.hosts == REGISTRIES


def test_no_hosts_means_no_network() -> None:
    assert not BuildEgress((), None).network().egress.enabled


def test_step_env_points_at_the_carried_in_bundle(tmp_path: Path) -> None:
    assert BuildEgress(REGISTRIES, None).step_env() == {}
    env = BuildEgress(REGISTRIES, tmp_path / "ca.pem").step_env()
    assert env["PIP_CERT"] == env["NODE_EXTRA_CA_CERTS"] == env["SSL_CERT_FILE"] == GUEST_CA


def test_config_names_hosts_comma_separated_and_an_empty_bundle_is_none() -> None:
    config = load(
        env={"AENV_HOME": "/nonexistent", "AENV_BUILD_EGRESS": "a.test, *.b.test",
             "AENV_BUILD_CA_BUNDLE": ""}
    )  # fmt: skip
    assert config.build_egress == ("a.test", "*.b.test")
    assert config.build_ca_bundle is None
    assert load(env={"AENV_HOME": "/nonexistent"}).build_egress == REGISTRIES
