"""Template builds reach the hosts `build_egress` names, over HTTPS trusting `build_ca_bundle`,
and nothing else; the templates they make, and other sandboxes, keep their own egress.

The server here (test_network.py) names `allowed.test` in place of the package registries and
gives the test CA as the bundle, as a host behind a TLS-intercepting proxy would give its own:
no test reaches the real registries. Its resolver is at a private address, as a cloud host's
is: builds resolve the registries through it all the same."""

from __future__ import annotations

import os
import secrets

import httpx
import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException

from tests.e2e.internet import APT_PACKAGE, APT_SOURCE, PUBLIC
from tests.e2e.network.conftest import API

A, B = PUBLIC
FETCH = "import urllib.request as u; print(u.urlopen('https://allowed.test/').read().decode())"
# apt with the internet's package index alone (the base's own sources are not reachable here).
SOURCES = "/etc/apt/sources.list.d/internet.list"
APT = f"-o Dir::Etc::SourceList={SOURCES} -o Dir::Etc::SourceParts=/nonexistent"


def _delete(name: str) -> None:
    headers = {"X-API-Key": os.environ["E2B_API_KEY"]}
    httpx.delete(f"{API}/templates/{name}", headers=headers, timeout=60)


def test_build_reaches_the_registries_and_nothing_else() -> None:
    name = f"egress-{secrets.token_hex(3)}"
    steps = (
        Template()
        .from_template("base")
        # apt-get update resolves the index's host with the node's (private) resolver; a
        # failed fetch fails the step (by default apt only warns when a name does not resolve).
        .run_cmd(
            f"echo '{APT_SOURCE}' > {SOURCES} && apt-get update --error-on=any {APT}"
            f" && apt-cache {APT} policy {APT_PACKAGE} > /tmp/apt.txt",
            user="root",
        )
        # curl and Python's ssl both trust the carried-in bundle.
        .run_cmd(
            "curl -sS -m 10 https://allowed.test/ > /tmp/reached.txt && echo >> /tmp/reached.txt"
        )
        .run_cmd(f'python3 -c "{FETCH}" >> /tmp/reached.txt')
        # Judged by name: another name at the same address, and bare addresses, are refused.
        .run_cmd(f"! curl -s -m 5 --resolve other.test:80:{A} http://other.test/")
        .run_cmd(f"! curl -s -m 5 http://{B}/ && ! curl -s -m 5 https://other.test/")
    )
    try:
        Template.build(steps, alias=name)
        sandbox = Sandbox.create(name, timeout=120)
        try:
            run = sandbox.commands.run
            assert run("cat /tmp/reached.txt").stdout.split() == [A, A]
            assert "Candidate: 1.0" in run("cat /tmp/apt.txt").stdout
            # Nothing of the build's trust or policy stays in the template.
            assert (
                run("ls /etc/aenv-build 2>&1 || true")
                .stdout.strip()
                .endswith("No such file or directory")
            )
            assert run("echo ${SSL_CERT_FILE:-unset}").stdout.strip() == "unset"
            assert run(f"curl -s -m 5 http://{B}/").stdout == B
        finally:
            sandbox.kill()
    finally:
        _delete(name)


def test_a_step_reaching_elsewhere_fails_the_build() -> None:
    name = f"egress-bad-{secrets.token_hex(3)}"
    steps = Template().from_template("base").run_cmd(f"curl -sS -m 5 http://{B}/")
    with pytest.raises(BuildException, match="exited with code"):
        Template.build(steps, alias=name)


def test_sandboxes_keep_their_own_egress() -> None:
    sandbox = Sandbox.create(timeout=120, allow_internet_access=False)
    try:
        out = sandbox.commands.run("curl -s -m 5 https://allowed.test/ || echo refused").stdout
        assert out.strip() == "refused"
    finally:
        sandbox.kill()
