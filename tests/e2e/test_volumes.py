"""End-to-end volumes: a real `aenv server` booting real VMs that mount volumes over virtio-9p,
driven by the unmodified e2b SDKs (Python and npm) from inside the server's namespace
(`volumes/`), across a graceful restart of the server.

The same server runs the exhaustion suite (`inner/test_exhaustion.py`), which needs a server but
not test_server.py's: it balances the two lanes of `make test` (its hostile guests keep a core
busy for a minute)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest

from aenv.config import Paths
from aenv.orchestrator.images import prepare_images
from tests.e2e.server_ns import server_in_namespace
from tests.e2e.test_server import EXHAUSTION, suite
from tests.support.guest import GUEST_CACHE, MIRROR
from tests.support.js import ensure_npm_sdk
from tests.support.volume_mounts import release_volume_images

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_volumes_with_the_sdk_across_a_restart() -> None:
    # A short path: VMM control sockets live under the data dir and AF_UNIX caps paths at 107.
    scratch = Path(tempfile.mkdtemp(prefix="aenv-e2e-vol-"))
    try:
        home = scratch / "home"
        asyncio.run(prepare_images(Paths(home).cache, GUEST_CACHE, MIRROR))
        ensure_npm_sdk()  # the server's namespace has no route to the npm registry
        with server_in_namespace(home) as server:
            suite(server, "volumes/test_shared.py")
            suite(server, "volumes/test_js_sdk.py")
            suite(server, "volumes/test_content.py")
            suite(server, EXHAUSTION)
            server.stop()
            server.start()
            suite(server, "volumes/test_after_restart.py")
        # Every test deleted its volumes, and the server's stop unmounted their images.
        assert list(Paths(home).volumes.iterdir()) == []
        assert list(Paths(home).volume_images.iterdir()) == []
    finally:
        release_volume_images(scratch)  # what a server killed mid-run left mounted
        shutil.rmtree(scratch, ignore_errors=True)
