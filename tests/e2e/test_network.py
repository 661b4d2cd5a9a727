"""End-to-end network rules: a real `aenv server` booting real VMs, driven by the unmodified
e2b SDK, with a simulated internet behind the server's namespace (internet.py). The SDK tests
live in `network/` and run inside the server's namespace, as test_server.py's do."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from aenv.orchestrator.images import prepare_images
from tests.e2e.internet import RESOLVER_IP, simulated_internet
from tests.e2e.server_ns import REPO, server_in_namespace
from tests.e2e.test_server import suite

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_network_rules_with_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="aenv-e2e-net-"))
    try:
        home = scratch / "home"
        os.environ.setdefault("AENV_GUEST_CACHE", str(REPO / "build" / "guest-cache"))
        asyncio.run(prepare_images(home / "cache"))
        # Sandboxes with domain rules resolve allowed names with the internet's resolver.
        monkeypatch.setenv("AENV_NETWORK_DNS", RESOLVER_IP)
        with (
            server_in_namespace(home) as server,
            simulated_internet(server.netns, scratch / "internet") as internet,
        ):
            server.env["AENV_TEST_INTERNET_CA"] = str(internet.ca_pem)
            suite(server, "network")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
