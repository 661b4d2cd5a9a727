from __future__ import annotations

import json
import subprocess
import sys

from e2b import Sandbox


def aenv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aenv.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_ls_info_timeout_rm() -> None:
    sandbox = Sandbox.create(metadata={"cli": "yes"}, timeout=120)
    listed = json.loads(aenv("ls", "--json").stdout)
    assert sandbox.sandbox_id in [s["sandboxID"] for s in listed]
    detail = json.loads(aenv("info", sandbox.sandbox_id, "--json").stdout)
    assert detail["metadata"] == {"cli": "yes"} and "envdAccessToken" not in detail
    before = sandbox.get_info().end_at
    assert aenv("timeout", sandbox.sandbox_id, "600").returncode == 0
    assert sandbox.get_info().end_at > before
    removed = aenv("rm", sandbox.sandbox_id)
    assert removed.returncode == 0 and removed.stdout.strip() == sandbox.sandbox_id
    missing = aenv("info", sandbox.sandbox_id)
    assert missing.returncode == 1 and "404" in missing.stderr
