"""The official E2B CLI (`@e2b/cli`, pinned in tests/js/cli) lists a node's templates and
sandboxes, over a node on doubles served on loopback."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tests.api.test_routes import KEY, served
from tests.doubles.node import double_node
from tests.support.js import ensure_npm_cli


async def _cli(executable: Path, home: Path, url: str, *args: str) -> str:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),  # the CLI reads ~/.e2b: nothing of the host's
        "E2B_API_URL": url,
        "E2B_API_KEY": KEY,
        "E2B_ACCESS_TOKEN": KEY,  # the node takes its API keys as bearer tokens too
    }
    proc = await asyncio.create_subprocess_exec(
        str(executable), *args, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode == 0, output.decode()
    return output.decode()


async def test_the_cli_lists_templates_and_sandboxes(tmp_path: Path) -> None:
    executable = await asyncio.to_thread(ensure_npm_cli)
    if executable is None:
        pytest.skip("node and npm are needed for the E2B CLI")
    async with double_node(tmp_path) as node, served(node) as api:
        created = await api.post(
            "/v2/sandboxes", json={"templateID": "base", "metadata": {"m": "cli"}}
        )
        sandbox = created.json()["sandboxID"]
        url = str(api.base_url)
        templates = await _cli(executable, tmp_path, url, "template", "list")
        assert "base" in templates and node.templates.get("base").envd_version in templates
        sandboxes = await _cli(executable, tmp_path, url, "sandbox", "list")
        assert sandbox in sandboxes and '{"m":"cli"}' in sandboxes
