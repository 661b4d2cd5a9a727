"""A paused sandbox resumed on a node that lacks its checkpoint, on doubles sharing one
repository: its memory and read-only drives are served as the guest reads them
(`orchestrator/lazy.py`), kept beside its VM and ended with it (pause, kill), never left
mounted; a pause waits until they are local and records what the guest needed for the next
lazy resume; a chunk no source gives fails the resume with the reason, the sandbox paused as it
was; `lazy_pulls` off pulls whole. A snapshot whose files the node lost starts its sandboxes
while its files are served the same way, its serving shared by them and kept until the node
closes."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from aenv.orchestrator.archive import PREFETCH
from aenv.orchestrator.catalog import record_from_json, record_to_json
from aenv.orchestrator.errors import OperationFailed
from aenv.orchestrator.states import SandboxState
from aenv.storage import lazytree
from aenv.storage.fusefile import SOURCE
from aenv.storage.repository.chunks import chunk_key
from tests.doubles.node import DoubleNode, double_node
from tests.support.wait import eventually

pytestmark = pytest.mark.skipif(not lazytree.available(), reason="FUSE mounts need root")

# A cluster node's archive (its copies carry their images); no Redis is reached here.
REDIS = "redis://127.0.0.1:1/0"


def mounts_under(home: Path) -> list[str]:
    with open("/proc/self/mountinfo") as mounts:
        return [line for line in mounts if f" - fuse {SOURCE} " in line and f" {home}/" in line]


@asynccontextmanager
async def moved(tmp_path: Path, **settings: Any) -> AsyncIterator[tuple[DoubleNode, str]]:
    """Node `b`, and a sandbox made on node `a`, released there and adopted by `b` (paused)."""
    shared = str(tmp_path / "repository")
    try:
        async with (
            double_node(tmp_path / "a", redis_url=REDIS, repository=shared) as a,
            double_node(tmp_path / "b", redis_url=REDIS, repository=shared, **settings) as b,
        ):
            record, _ = await a.orchestrator.create(a.request())
            a.guest(record.id).write("/data", "kept")
            released = await a.orchestrator.release(record.id)
            await b.orchestrator.adopt(record_from_json(record_to_json(released)))
            yield b, record.id
        assert mounts_under(tmp_path) == []
    finally:
        lazytree.sweep(tmp_path)


async def test_served_beside_the_vm_then_local_and_recorded(tmp_path: Path) -> None:
    async with moved(tmp_path) as (b, sandbox_id):
        await b.orchestrator.resume(sandbox_id, 60)
        assert b.guest(sandbox_id).read("/data") == "kept"
        lazy = b.orchestrator.node.saved.lazy
        tree = lazy.serving(sandbox_id)
        assert tree is not None  # kept while the VM runs
        served = sorted(tree.touched)
        assert served[0].startswith("images/") and served[-1] == "memory"
        await tree.wait_whole()
        assert mounts_under(b.config.home) == []  # local now, nothing mounted any more
        # What the guest read when it was restored, unless the background fetch came first.
        touched = tree.touched
        assert set(touched["memory"]) <= {0}

        paused = await b.orchestrator.pause(sandbox_id)
        assert lazy.serving(sandbox_id) is None  # ended with its VM
        saved = b.orchestrator.node.saved
        while (archived := b.row(sandbox_id).archived) is None or (
            archived.seq != paused.checkpoint_seq
        ):
            await asyncio.sleep(0.01)  # detached, then uploaded in the background
        assert saved.archive is not None
        manifest = await saved.archive.repository.manifest(archived.manifest)
        assert json.loads(str(manifest.metadata[PREFETCH])) == touched

        await b.orchestrator.resume(sandbox_id, 60)  # its own, local checkpoint
        assert lazy.serving(sandbox_id) is None
        assert b.guest(sandbox_id).read("/data") == "kept"


async def test_a_kill_ends_the_serving(tmp_path: Path) -> None:
    async with moved(tmp_path) as (b, sandbox_id):
        await b.orchestrator.resume(sandbox_id, 60)
        assert b.orchestrator.node.saved.lazy.serving(sandbox_id) is not None
        await b.orchestrator.kill(sandbox_id)
        assert b.orchestrator.node.saved.lazy.serving(sandbox_id) is None
        assert mounts_under(b.config.home) == []
        assert not (b.config.paths.sandboxes / sandbox_id).exists()


async def test_a_chunk_no_source_gives_fails_the_resume(tmp_path: Path) -> None:
    async with moved(tmp_path) as (b, sandbox_id):
        saved = b.orchestrator.node.saved
        assert saved.archive is not None
        archived = b.row(sandbox_id).archived
        assert archived is not None
        manifest = await saved.archive.repository.manifest(archived.manifest)
        memory = next(f for f in manifest.files if f.path == "memory")
        for digest in memory.chunks:
            if digest is not None:
                saved.archive.repository.store.delete(chunk_key(digest))
        with pytest.raises(OperationFailed, match=f"resume of sandbox {sandbox_id} failed"):
            await b.orchestrator.resume(sandbox_id, 60)
        assert b.row(sandbox_id).state is SandboxState.PAUSED
        assert saved.lazy.serving(sandbox_id) is None
        assert mounts_under(b.config.home) == []
        assert b.driver.running == {}


async def test_lazy_pulls_off_pulls_whole(tmp_path: Path) -> None:
    async with moved(tmp_path, lazy_pulls=False) as (b, sandbox_id):
        await b.orchestrator.resume(sandbox_id, 60)
        assert b.guest(sandbox_id).read("/data") == "kept"
        assert b.orchestrator.node.saved.lazy.serving(sandbox_id) is None
        assert mounts_under(b.config.home) == []


@asynccontextmanager
async def lost_snapshot(tmp_path: Path, **settings: Any) -> AsyncIterator[tuple[DoubleNode, str]]:
    """A node, and the name of a snapshot it holds only in the repository (its local files
    removed, as on a node that never had them)."""
    try:
        async with double_node(
            tmp_path, redis_url=REDIS, repository=str(tmp_path / "repository"), **settings
        ) as node:
            record, _ = await node.orchestrator.create(node.request())
            node.guest(record.id).write("/state", "snapped")
            snap = await node.orchestrator.snapshot(record.id, name="kept")
            await eventually(
                lambda: (node.templates.by_id(snap.template_id) or snap).manifest_id is not None
            )
            await node.orchestrator.kill(record.id)
            shutil.rmtree(snap.snapshot_dir)
            shutil.rmtree(node.templates.build_memory_dir(snap.template_id, snap.build_id))
            yield node, "kept"
        assert mounts_under(tmp_path) == []
    finally:
        lazytree.sweep(tmp_path)


async def test_a_snapshot_the_node_lacks_is_served_to_its_sandboxes(tmp_path: Path) -> None:
    async with lost_snapshot(tmp_path) as (node, name):
        child, _ = await node.orchestrator.create(node.request(template=name))
        assert node.guest(child.id).read("/state") == "snapped"
        saved = node.orchestrator.node.saved
        snap = node.templates.get(name)
        tree = saved.served_template(snap)
        assert tree is not None and "memory" in tree.touched
        # Another start takes the served state (never a second pull), also once it is whole.
        other, _ = await node.orchestrator.create(node.request(template=name))
        assert node.guest(other.id).read("/state") == "snapped"
        await tree.wait_whole()
        assert mounts_under(node.config.home) == []  # local now: nothing mounted
        assert saved.served_template(snap) is tree
        # A pause waits until the files are whole, then resumes as any.
        await node.orchestrator.pause(child.id)
        await node.orchestrator.resume(child.id, 60)
        assert node.guest(child.id).read("/state") == "snapped"
        await node.orchestrator.kill(child.id)
        await node.orchestrator.kill(other.id)
        third, _ = await node.orchestrator.create(node.request(template=name))
        assert node.guest(third.id).read("/state") == "snapped"


async def test_lazy_pulls_off_pulls_a_lost_snapshot_whole(tmp_path: Path) -> None:
    async with lost_snapshot(tmp_path, lazy_pulls=False) as (node, name):
        child, _ = await node.orchestrator.create(node.request(template=name))
        assert node.guest(child.id).read("/state") == "snapped"
        snap = node.templates.get(name)
        assert node.orchestrator.node.saved.served_template(snap) is None
