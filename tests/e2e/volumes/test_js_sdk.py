"""The npm `e2b` SDK's volumes against the server (installed beforehand by test_volumes.py:
this namespace has no route to the npm registry)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.support.js import JS_DIR


def test_npm_sdk_volumes() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is needed for the npm e2b SDK")
    result = subprocess.run(
        [node, "server_volumes.mjs"], cwd=JS_DIR, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "listed": True,
        "readInB": "written by js a",
        "info": [{"name": "js-shared", "path": "/mnt/js"}],
        "destroyWhileMounted": "refused",
        "destroyed": True,
    }
