"""The npm `e2b` SDK's volumes against the server (installed beforehand by test_volumes.py:
this namespace has no route to the npm registry)."""

from __future__ import annotations

from tests.support.js import run_node_script


def test_npm_sdk_volumes() -> None:
    assert run_node_script("server_volumes.mjs", timeout=600) == {
        "listed": True,
        "readInB": "written by js a",
        "readByApi": "written by js a",
        "apiWriteInA": "written by the js api",
        "apiList": ["from-a", "from-api"],
        "info": [{"name": "js-shared", "path": "/mnt/js"}],
        "destroyWhileMounted": "refused",
        "destroyed": True,
    }
