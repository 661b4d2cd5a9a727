"""Publishing at the node's start (run by test_server.py right after a start with
`publish_code_interpreter` on and a stand-in definition, restart/publish/template.yaml): the
code interpreter SDK's `Sandbox.create()` answers a clear "not ready yet" while the template
builds, and a sandbox of it once it is built."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from e2b import SandboxException
from e2b_code_interpreter import Sandbox

BASE = "http://127.0.0.1:3000"
NAME = "code-interpreter-v1"
# A build boots a VM from `base` and runs its step: well under this under TCG.
_BUILT_WITHIN_S = 600.0


def _ready_names() -> set[str]:
    """Names of the listed templates whose newest build is ready (a template whose first build
    is waiting or running is listed too, as in E2B)."""
    headers = {"X-API-Key": os.environ["E2B_API_KEY"]}
    response = httpx.get(f"{BASE}/v2/templates", headers=headers, timeout=30)
    response.raise_for_status()
    return {str(n) for t in response.json() if t["buildStatus"] == "ready" for n in t["names"]}


def test_sandbox_create_waits_for_the_published_template() -> None:
    # The step sleeps for seconds, the test starts at once: the build is still running.
    with pytest.raises(SandboxException, match="has no ready build") as refused:
        Sandbox.create(timeout=60)
    assert refused.value.status_code == 404
    assert NAME in str(refused.value) and "retry when it is ready" in str(refused.value)
    deadline = time.monotonic() + _BUILT_WITHIN_S
    while NAME not in _ready_names():
        assert time.monotonic() < deadline, f"{NAME} was not published"
        time.sleep(1)
    sandbox = Sandbox.create(timeout=60)
    try:
        assert sandbox.files.read("/home/user/published.txt") == "stand-in\n"
    finally:
        sandbox.kill()
        httpx.delete(
            f"{BASE}/templates/{NAME}", headers={"X-API-Key": os.environ["E2B_API_KEY"]}, timeout=60
        ).raise_for_status()
