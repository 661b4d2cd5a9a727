"""Sandboxes moving between two nodes that share one snapshot repository (a cluster), on the
orchestrator's doubles: a released sandbox (paused, its copy uploaded, forgotten) is adopted by
the other node and resumes there with its files; what cannot move is refused and stays; a
sandbox forgotten after a partition leaves its repository copy to the node that holds it; a
snapshot one node made starts sandboxes on the other, which adopts its record and pulls it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from aenv.orchestrator.catalog import VolumeMount, record_from_json, record_to_json
from aenv.orchestrator.lifecycle import InvalidState, OperationFailed
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.templates import template_from_json, template_to_json
from tests.doubles.node import double_node

# A cluster node's archive (its copies carry their images); no Redis is reached here.
REDIS = "redis://127.0.0.1:1/0"


async def test_a_released_sandbox_resumes_on_another_node(tmp_path: Path) -> None:
    shared = str(tmp_path / "repository")
    async with (
        double_node(tmp_path / "a", redis_url=REDIS, repository=shared) as a,
        double_node(tmp_path / "b", redis_url=REDIS, repository=shared) as b,
    ):
        record, _ = await a.orchestrator.create(a.request())
        a.guest(record.id).write("/data", "kept")
        released = await a.orchestrator.release(record.id)  # running: paused, then uploaded
        assert released.state is SandboxState.PAUSED and released.archived is not None
        assert released.archived.seq == released.checkpoint_seq == 1
        assert a.catalog.get(record.id) is None
        assert not (a.config.paths.sandboxes / record.id).exists()
        assert a.driver.running == {}

        travelled = record_from_json(record_to_json(released))
        adopted = await b.orchestrator.adopt(travelled)
        assert adopted.restored_from == "" and adopted.state is SandboxState.PAUSED
        assert await b.orchestrator.adopt(travelled) == b.row(record.id)  # held already
        await b.orchestrator.resume(record.id, 60)
        assert b.guest(record.id).read("/data") == "kept"
        assert b.guest(record.id).token == record.envd_access_token
        # Its images came with the copy: none of `a`'s paths is used.
        vm = b.driver.running[b.orchestrator.guest_endpoint(record.id).incarnation]
        assert str(a.config.home) not in str(vm.spec)


async def test_what_cannot_move_is_refused_and_stays(tmp_path: Path) -> None:
    async with double_node(tmp_path / "off", repository="off", redis_url=REDIS) as node:
        record, _ = await node.orchestrator.create(node.request())
        with pytest.raises(OperationFailed, match="no snapshot repository"):
            await node.orchestrator.release(record.id)
        assert node.row(record.id).state is SandboxState.RUNNING
    async with double_node(tmp_path / "a", redis_url=REDIS) as node:
        record, _ = await node.orchestrator.create(node.request())
        node.catalog.update(record.id, volume_mounts=(VolumeMount("vol1", "/mnt/v"),))
        with pytest.raises(InvalidState, match="mounts volumes"):
            await node.orchestrator.release(record.id)
        assert node.row(record.id).state is SandboxState.RUNNING
        with pytest.raises(InvalidState, match="no copy in the repository"):
            await node.orchestrator.adopt(node.row(record.id))


async def test_a_forgotten_sandbox_leaves_its_copy(tmp_path: Path) -> None:
    async with double_node(tmp_path, redis_url=REDIS) as node:
        record, _ = await node.orchestrator.create(node.request())
        released = await node.orchestrator.release(record.id)
        assert released.archived is not None
        await node.orchestrator.adopt(released)
        await node.orchestrator.resume(record.id, 60)
        assert await node.orchestrator.forget(record.id)
        assert not await node.orchestrator.forget(record.id)
        assert node.catalog.get(record.id) is None and node.driver.running == {}
        archive = node.orchestrator.saved.archive
        assert archive is not None
        assert await archive.repository.manifest(released.archived.manifest)


async def test_a_snapshot_made_on_one_node_starts_sandboxes_on_another(tmp_path: Path) -> None:
    shared = str(tmp_path / "repository")
    async with (
        double_node(tmp_path / "a", redis_url=REDIS, repository=shared) as a,
        double_node(tmp_path / "b", redis_url=REDIS, repository=shared) as b,
    ):
        record, _ = await a.orchestrator.create(a.request())
        a.guest(record.id).write("/data", "snapped")
        made = await a.orchestrator.snapshot(record.id, name="travels")
        with pytest.raises(OperationFailed, match="only snapshots and built templates stored"):
            await b.orchestrator.adopt_template(made)  # not uploaded yet
        while (stored := a.orchestrator.templates.by_id(made.template_id)) is None or (
            stored.manifest_id is None
        ):
            await asyncio.sleep(0.01)  # the upload runs in the background

        adopted = await b.orchestrator.adopt_template(template_from_json(template_to_json(stored)))
        assert adopted.snapshot_dir.startswith(str(b.config.home))
        assert await b.orchestrator.adopt_template(stored) == adopted  # held already
        child, _ = await b.orchestrator.create(b.request(template="travels"))
        assert b.guest(child.id).read("/data") == "snapped"
        # Its images came with the copy: none of `a`'s paths is used.
        vm = b.driver.running[b.orchestrator.guest_endpoint(child.id).incarnation]
        assert str(a.config.home) not in str(vm.spec)
