"""The npm `e2b` SDK against the server (installed beforehand by test_server.py: this
namespace has no route to the npm registry)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.support.js import JS_DIR


def test_npm_sdk_create_run_files_list_kill() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is needed for the npm e2b SDK")
    assert (JS_DIR / "node_modules" / "e2b").exists(), "test_server.py installs the npm SDK"
    result = subprocess.run(
        [node, "server_smoke.mjs"], cwd=JS_DIR, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "run": "js user\n",
        "read": "written by js",
        "listed": True,
        "info": {"templateId": "base", "metadata": {"sdk": "js"}},
        "running": True,
        "killed": True,
    }


def test_npm_sdk_pause_connect_snapshots_fork() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is needed for the npm e2b SDK")
    result = subprocess.run(
        [node, "server_snapshots.mjs"], cwd=JS_DIR, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "paused": True,
        "pausedAgain": False,
        "stateWhilePaused": "paused",
        "readAfterResume": "kept",
        "snapshotNames": ["js-snapshot"],
        "snapshotListed": True,
        "readFromSnapshot": "kept",
        "forked": 2,
        "forkRead": ["kept", "kept"],
        "snapshotDeleted": True,
        "autoPaused": "paused",
        "autoResumed": True,
        "killed": True,
    }


def test_npm_sdk_parity() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is needed for the npm e2b SDK")
    result = subprocess.run(
        [node, "server_parity.mjs"], cwd=JS_DIR, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "mcp": "refused",
        "resolves": True,
        "afterTimeoutZero": "paused",
        "killed": True,
    }
