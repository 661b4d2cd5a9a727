"""The npm `e2b` SDK (pinned in js/package.json) against the session envd in debug mode: run,
background/kill/list, write/read, list, stat, make_dir, rename, remove, watchDir."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from e2b import Sandbox

from tests.support.js import JS_DIR, ensure_npm_sdk


@pytest.fixture(scope="module")
def node_modules() -> Path:
    modules = ensure_npm_sdk()
    if modules is None:
        pytest.skip("node and npm are needed for the npm e2b SDK smoke test")
    return modules


def test_js_sdk_smoke(node_modules: Path, sandbox: Sandbox, envd_url: str) -> None:
    smoke_dir = f"/home/user/js-{uuid.uuid4().hex[:8]}"
    sandbox.files.make_dir(smoke_dir)
    env = {
        **os.environ,
        "E2B_DEBUG": "true",
        "SMOKE_DIR": smoke_dir,
        # Debug mode dials localhost:49983; envd listens on IPv4 only.
        "NODE_OPTIONS": "--dns-result-order=ipv4first",
    }
    try:
        result = subprocess.run(
            [shutil.which("node") or "node", "envd_smoke.mjs"],
            cwd=JS_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        sandbox.files.remove(smoke_dir)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])

    assert out["run"] == {
        "stdout": "hello\nuser\n/home/user\n",
        "stderr": "err\n",
        "exitCode": 0,
    }
    assert out["exit"] == {"isCommandExitError": True, "exitCode": 3}
    assert out["envCwd"] == "bar\n/tmp\n"
    assert out["listed"] is True
    assert out["killed"] is True
    assert out["killedExitCode"] == -1
    assert out["streamed"] == {"joined": "1\n2\n3\n", "stdout": "1\n2\n3\n"}
    assert out["write"] == {"path": f"{smoke_dir}/hello.txt", "name": "hello.txt"}
    assert out["read"] == "hello from js"
    assert out["readBytesLength"] == len("hello from js")
    assert out["list"] == [["a", "dir"], ["hello.txt", "file"]]
    assert out["listDeep"] == sorted(
        [
            f"{smoke_dir}/a",
            f"{smoke_dir}/a/b",
            f"{smoke_dir}/a/b/two.txt",
            f"{smoke_dir}/a/one.txt",
            f"{smoke_dir}/hello.txt",
        ]
    )
    assert out["stat"] == {
        "size": len("hello from js"),
        "owner": "user",
        "permissions": "-rw-r--r--",
        "isFile": True,
    }
    assert out["exists"] == [True, False]
    assert out["makeDir"] == [True, False]
    assert out["renamed"] == "hello from js"
    assert out["removed"] is True
    assert out["watchEvents"][:3] == ["create", "chmod", "write"]
