"""After the server restarted: volume `kept` (test_shared.py) is still listed, with its files."""

from __future__ import annotations

from e2b import Sandbox, Volume

from tests.e2e.inner.conftest import LIFETIME


def test_a_volume_survives_a_server_restart() -> None:
    (kept,) = [v for v in Volume.list() if v.name == "kept"]
    sandbox = Sandbox.create(timeout=LIFETIME, volume_mounts={"/kept": "kept"})
    try:
        assert sandbox.files.read("/kept/note") == "before the pause"
    finally:
        sandbox.kill()
    assert Volume.destroy(kept.volume_id) is True
