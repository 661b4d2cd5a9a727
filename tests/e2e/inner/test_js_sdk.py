"""The npm `e2b` SDK against the server (installed beforehand by test_server.py: this
namespace has no route to the npm registry)."""

from __future__ import annotations

from tests.support.js import run_node_script


def test_npm_sdk_create_run_files_list_kill() -> None:
    assert run_node_script("server_smoke.mjs", timeout=300) == {
        "run": "js user\n",
        "read": "written by js",
        "listed": True,
        "info": {"templateId": "base", "metadata": {"sdk": "js"}},
        "running": True,
        "killed": True,
    }


def test_npm_sdk_pause_connect_snapshots_fork() -> None:
    assert run_node_script("server_snapshots.mjs", timeout=600) == {
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
    assert run_node_script("server_parity.mjs", timeout=300) == {
        "mcp": "refused",
        "resolves": True,
        "afterTimeoutZero": "paused",
        "killed": True,
    }
