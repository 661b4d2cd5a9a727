"""The node's background publication of code-interpreter-v1 (`aenv.publish`) does not give up
at its first failure: a build that failed (a registry down for a while) is tried again while
the node runs, through the node's own API, as at start. A definition that is not one stops the
server's start as a configuration error, before the node makes anything."""

from __future__ import annotations

import asyncio
from pathlib import Path

from typer.testing import CliRunner

from aenv.api.app import create_api, node_builder
from aenv.api.keys import KeyStore
from aenv.cli import app as cli
from aenv.orchestrator.build_records import Build, BuildStatus
from aenv.orchestrator.builds import Builder
from aenv.publish import Publication, Published
from tests.doubles.node import DoubleNode, double_node
from tests.support.loopback_api import served

KEY = "e2b_" + "cd" * 20
# Its base image is on a registry that refuses connections (loopback, nothing listens).
FAILING = {"name": "published", "fromImage": "127.0.0.1:9/nothing:latest"}


async def test_a_failed_publication_is_tried_again(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        keys = KeyStore(tmp_path / "api-keys.json")
        keys.add(KEY, "test")
        builder = node_builder(node.orchestrator, node.config)
        app = create_api(node.orchestrator, node.config, keys, builder)
        async with served(app) as url:
            await _retried(url, node, builder, tmp_path)


async def _retried(url: str, node: DoubleNode, builder: Builder, tmp_path: Path) -> None:
    """Publish FAILING through the API at `url` until three builds have failed."""
    publication = Publication(
        Published(tmp_path / "template.yaml", FAILING),
        url,
        KEY,
        node.orchestrator.templates,
        builder,
        builder.reserve("published"),
    )
    running = asyncio.create_task(publication.run(lambda: True, retry_after=0.01))
    try:
        async with asyncio.timeout(120):
            while len(_failed(builder.builds_of("published"))) < 3:
                assert not running.done(), running
                await asyncio.sleep(0.05)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


def _failed(builds: list[Build]) -> list[Build]:
    return [b for b in builds if b.status is BuildStatus.ERROR]


def test_a_bad_definition_stops_the_server_before_it_makes_anything(tmp_path: Path) -> None:
    definition = tmp_path / "template.yaml"
    definition.write_text("name: published\nmemoryMb: 1024\n")
    home = tmp_path / "home"
    env = {"AENV_CODE_INTERPRETER_DEFINITION": str(definition)}
    result = CliRunner().invoke(cli, ["server", "--home", str(home)], env=env)
    assert result.exit_code == 2, result.output
    assert "configuration error: code_interpreter_definition:" in result.output
    assert "unknown keys memoryMb" in result.output
    assert not home.exists() or list(home.iterdir()) == []
