"""A node started as the README says, on a host as most are: `aenv server` with its default
configuration (only its home and port), on a host whose /etc/resolv.conf names a resolver at a
private address (a cloud VPC's), with the package registries behind it (the simulated internet,
internet.py, hosts them and answers for their names). What a new user does first then runs
inside its namespace (first_contact/), and must all work."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from aenv.orchestrator.images import prepare_images
from tests.e2e.first_contact.conftest import PORT
from tests.e2e.internet import NODE_RESOLVER_IP, Certificates, simulated_internet
from tests.e2e.server_ns import REPO, server_in_namespace, with_resolv_conf
from tests.support.guest import GUEST_CACHE, MIRROR

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_a_node_started_as_the_readme_says() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="aenv-e2e-first-"))
    try:
        home = scratch / "home"
        # From this namespace, which has the mirrors: the node's has only the simulated internet.
        asyncio.run(prepare_images(home / "cache", GUEST_CACHE, MIRROR))
        certificates = Certificates.make(scratch / "certificates")
        resolv_conf = scratch / "resolv.conf"
        resolv_conf.write_text(f"nameserver {NODE_RESOLVER_IP}\n")
        with (
            server_in_namespace(home, PORT, configured=False, resolv_conf=resolv_conf) as server,
            simulated_internet(server.netns, certificates),
        ):
            suite = str(REPO / "tests" / "e2e" / "first_contact")
            argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
                    "--rootdir", str(REPO), suite]  # fmt: skip
            code, output = server.run(*with_resolv_conf(resolv_conf, argv), timeout=1700)
            assert code == 0, server.failure("first contact", output)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
