"""End-to-end network rules and TLS: a real `aenv server` booting real VMs, driven by the
unmodified e2b SDK, with a simulated internet behind the server's namespace (internet.py).

The server serves HTTPS for its domain (`aenv server --domain --tls-cert --tls-key`, a
certificate from the test's CA) on port 443, and the clients find it through the internet's
resolver: the SDK gets `E2B_DOMAIN` alone, as against E2B's cloud. The SDK tests live in
`network/` and run inside the server's namespace, as test_server.py's do, in a mount namespace
of their own whose /etc/resolv.conf names that resolver.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from aenv.orchestrator.images import prepare_images
from tests.e2e.internet import NODE_DOMAIN, NODE_RESOLVER_IP, Certificates, simulated_internet
from tests.e2e.server_ns import REPO, ServerNs, server_in_namespace, with_resolv_conf
from tests.support.guest import GUEST_CACHE, MIRROR
from tests.support.js import ensure_npm_sdk

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_network_rules_and_tls_with_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="aenv-e2e-net-"))
    try:
        home = scratch / "home"
        asyncio.run(prepare_images(home / "cache", GUEST_CACHE, MIRROR))
        ensure_npm_sdk()  # the server's namespace has no route to the npm registry
        certificates = Certificates.make(scratch / "certificates")
        for key, value in {
            # Sandboxes with domain rules and builds resolve allowed names with the internet's
            # resolver, at a private address as a cloud host's is (sandboxes may not reach it).
            "AENV_NETWORK_DNS": NODE_RESOLVER_IP,
            # Template builds reach this host in place of the package registries, trusting
            # the test CA as they would a host's TLS-intercepting proxy (network/test_build_egress).
            "AENV_BUILD_EGRESS": "allowed.test",
            "AENV_BUILD_CA_BUNDLE": str(certificates.ca),
            # The servers of names with header rules are verified against the test CA.
            "AENV_NETWORK_RULES_CA": str(certificates.ca),
            "AENV_DOMAIN": NODE_DOMAIN,
            "AENV_TLS_CERT": str(certificates.node),
            "AENV_TLS_KEY": str(certificates.node_key),
            # The clients' trust: Python's ssl, httpx and the SDK's transports read it.
            "SSL_CERT_FILE": str(certificates.ca),
        }.items():
            monkeypatch.setenv(key, value)
        with (
            server_in_namespace(home, port=443) as server,
            simulated_internet(server.netns, certificates),
        ):
            _suite(server, certificates.resolv_conf)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _suite(server: ServerNs, resolv_conf: Path) -> None:
    pytest_argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                   "--tb=short", "--rootdir", str(REPO),
                   str(REPO / "tests" / "e2e" / "network")]  # fmt: skip
    code, output = server.run(*with_resolv_conf(resolv_conf, pytest_argv), timeout=1700)
    assert code == 0, server.failure("network suite", output)
