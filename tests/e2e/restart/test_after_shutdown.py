"""After a graceful restart: the sandboxes that were running are listed as paused and resume
with their files and their processes' memory; the failed build still reports its status and log."""

import json
import os
import time
from pathlib import Path

import httpx
from e2b import Sandbox


def test_shutdown_paused_them_and_they_resume() -> None:
    before = json.loads(Path(os.environ["AENV_HOME"], "shutdown.json").read_text())
    listed = {s.sandbox_id: s.state.value for s in Sandbox.list().next_items()}
    for n, (sandbox_id, counter) in enumerate(before.items()):
        assert listed.get(sandbox_id) == "paused"
        sbx = Sandbox.connect(sandbox_id, timeout=60)
        try:
            assert sbx.files.read("/home/user/note.txt") == f"note {n}"
            time.sleep(0.3)
            assert int(sbx.files.read("/tmp/counter")) > counter
        finally:
            sbx.kill()


def test_the_failed_build_is_still_reported() -> None:
    before = json.loads(Path(os.environ["AENV_HOME"], "failed-build.json").read_text())
    headers = {"X-API-Key": os.environ["E2B_API_KEY"]}
    after = httpx.get(before["url"], headers=headers, timeout=30).json()
    assert after["status"] == "error"
    assert after["reason"] == before["status"]["reason"]
    assert "exited with code 3" in after["reason"]["message"]
    assert after["logEntries"] == before["status"]["logEntries"]
    assert any("about to fail" in e["message"] for e in after["logEntries"])
