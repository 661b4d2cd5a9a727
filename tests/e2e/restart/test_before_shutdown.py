"""Before a graceful shutdown: running sandboxes with files and a process counting in memory,
and a template build that failed. test_server.py then stops the server with SIGTERM (which
pauses the sandboxes) and starts it again."""

import json
import os
import time
from pathlib import Path

import httpx
from e2b import Sandbox

COUNTER = (
    "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.new; "
    "mv /tmp/counter.new /tmp/counter; sleep 0.1; done"
)


def test_sandboxes_running_at_shutdown() -> None:
    state = {}
    for n in range(2):
        sbx = Sandbox.create(timeout=600)
        sbx.files.write("/home/user/note.txt", f"note {n}")
        sbx.commands.run(COUNTER, background=True)
        sbx.commands.run("while [ ! -s /tmp/counter ]; do sleep 0.05; done", timeout=120)
        state[sbx.sandbox_id] = int(sbx.files.read("/tmp/counter"))
    Path(os.environ["AENV_HOME"], "shutdown.json").write_text(json.dumps(state))


def test_a_build_that_failed_before_shutdown() -> None:
    """Its record (status, reason, log) must still answer after the restart."""
    base, headers = "http://127.0.0.1:3000", {"X-API-Key": os.environ["E2B_API_KEY"]}
    ids = httpx.post(
        f"{base}/v3/templates", json={"name": "fails-before-restart"}, headers=headers, timeout=30
    ).json()
    steps = [{"type": "RUN", "args": ["echo about to fail; exit 3"]}]
    started = httpx.post(
        f"{base}/v2/templates/{ids['templateID']}/builds/{ids['buildID']}",
        json={"fromTemplate": "base", "steps": steps},
        headers=headers,
        timeout=30,
    )
    assert started.status_code == 202, started.text
    status_url = f"{base}/templates/{ids['templateID']}/builds/{ids['buildID']}/status"
    deadline = time.monotonic() + 300
    while (status := httpx.get(status_url, headers=headers, timeout=30).json())["status"] in (
        "waiting",
        "building",
    ):
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
    assert status["status"] == "error"
    Path(os.environ["AENV_HOME"], "failed-build.json").write_text(
        json.dumps({"url": status_url, "status": status})
    )
