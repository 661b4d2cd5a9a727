"""After a kill -9 of the server during a template build's RUN step (see in_flight.py): the
build is reported failed, the template it was making is listed only as an error, `base` still serves
creates, and the same build then succeeds. test_nothing_stale.py, run before this, checks that
nothing of the build's VM is left."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
from e2b import Sandbox, Template

from aenv.config import Paths
from tests.e2e.inner.conftest import BASE
from tests.e2e.restart.in_flight import BUILD_NAME

HOME = Path(os.environ["AENV_HOME"])


def _key() -> dict[str, str]:
    return {"X-API-KEY": Paths(HOME).api_key.read_text().strip()}


def _names(status: str = "ready") -> set[str]:
    """Names of the listed templates whose newest build has `status`."""
    response = httpx.get(f"{BASE}/v2/templates", headers=_key(), timeout=30)
    response.raise_for_status()
    return {str(name) for t in response.json() if t["buildStatus"] == status for name in t["names"]}


def test_the_cut_short_build_failed_and_the_template_builds_again() -> None:
    records = [json.loads(p.read_text()) for p in Paths(HOME).builds.glob("*.json")]
    (build,) = [r for r in records if r["name"] == BUILD_NAME]
    status = httpx.get(
        f"{BASE}/templates/{build['template_id']}/builds/{build['build_id']}/status",
        headers=_key(),
        timeout=30,
    ).json()
    assert status["status"] == "error", status
    assert BUILD_NAME not in _names()
    assert BUILD_NAME in _names("error")

    sandbox = Sandbox.create("base", timeout=120)
    try:
        assert sandbox.commands.run("echo still serves").stdout == "still serves\n"
    finally:
        sandbox.kill()

    rebuilt = Template().from_template("base").run_cmd("echo rebuilt > /tmp/rebuilt")
    info = Template.build(rebuilt, alias=BUILD_NAME)
    assert BUILD_NAME in _names()
    sandbox = Sandbox.create(BUILD_NAME, timeout=120)
    try:
        assert sandbox.files.read("/tmp/rebuilt") == "rebuilt\n"
    finally:
        sandbox.kill()
    deleted = httpx.delete(f"{BASE}/templates/{info.template_id}", headers=_key(), timeout=60)
    assert deleted.is_success, deleted.text
