"""The code interpreter server against the unmodified npm `@e2b/code-interpreter` SDK
(tests/js/code_interpreter.mjs)."""

from __future__ import annotations

import pytest

from tests.support.js import ensure_npm_sdk, run_node_script


def test_npm_sdk(server_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if ensure_npm_sdk() is None:
        pytest.skip("node and npm are needed for the npm SDK")
    monkeypatch.setenv("E2B_SANDBOX_URL", server_url)
    assert run_node_script("code_interpreter.mjs", timeout=300) == {
        "contexts": ["javascript", "python"],
        "text": "42",
        "stdout": ["hi\n"],
        "error": "ZeroDivisionError",
        "png": "PNG",
        "chart": {"type": "bar", "values": [1, 2]},
        "pie": {"title": None, "angles": [324, 36]},
        "images": ["PNG", "PNG"],
        "data": {"a": [1]},
        "js": "42",
        "jsEnv": ["Error", "unset"],
        "bash": ["3\n"],
        "timeout": "TimeoutError",
        "kept": "41",
    }
