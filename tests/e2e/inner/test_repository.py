"""Paused sandboxes and snapshots have durable copies in the node's snapshot repository (POSIX
by default, `$AENV_HOME/repository`): when the local files are lost, a resume or a create pulls
them back, verified; when the repository copy is damaged too, the operation fails with a clear
error and the sandbox stays paused."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2b import Sandbox, SandboxException

from aenv.config import Paths

HOME = Path(os.environ.get("AENV_HOME", "/nonexistent"))
REPOSITORY = Paths(HOME).repository


def _manifest_of(key: str, value: str, timeout: float = 120) -> dict[str, Any]:
    """The newest stored manifest whose metadata has `key` = `value` (uploads run after the
    pause or snapshot returns)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = []
        for path in (REPOSITORY / "manifests").glob("*.json"):
            manifest = json.loads(path.read_text())
            if manifest["metadata"].get(key) == value:
                found.append(manifest)
        if found:
            return max(found, key=lambda m: m["created"])
        time.sleep(0.5)
    raise AssertionError(f"no manifest for {key}={value} was stored")


def _recorded(template_json: Path, timeout: float = 120) -> None:
    """Wait until the template's record names its repository copy."""
    deadline = time.monotonic() + timeout
    while json.loads(template_json.read_text()).get("manifest_id") is None:
        assert time.monotonic() < deadline, f"{template_json} names no repository copy"
        time.sleep(0.2)


def _lose_local_checkpoints(sandbox_id: str) -> None:
    for checkpoint in (Paths(HOME).sandboxes / sandbox_id).glob("pause-*"):
        shutil.rmtree(checkpoint)


def _drop_chunk_cache() -> None:
    for entry in Paths(HOME).chunk_cache.iterdir():
        if entry.is_dir() and not entry.name.startswith("."):
            shutil.rmtree(entry)


@pytest.fixture
def paused() -> Iterator[Sandbox]:
    sbx = Sandbox.create(timeout=300)
    sbx.files.write("/home/user/durable.txt", "kept by the repository")
    assert sbx.pause() is True
    try:
        yield sbx
    finally:
        sbx.kill()


def test_resume_pulls_a_lost_checkpoint_from_the_repository(paused: Sandbox) -> None:
    _manifest_of("sandbox", paused.sandbox_id)
    _lose_local_checkpoints(paused.sandbox_id)
    resumed = Sandbox.connect(paused.sandbox_id, timeout=60)
    assert resumed.files.read("/home/user/durable.txt") == "kept by the repository"
    # And the pulled copy works as a base for the next cycles.
    resumed.files.write("/home/user/second.txt", "after the pull")
    assert resumed.pause() is True
    again = Sandbox.connect(paused.sandbox_id, timeout=60)
    assert again.files.read("/home/user/second.txt") == "after the pull"


def test_damaged_repository_copy_is_refused_and_the_sandbox_stays_paused(
    paused: Sandbox,
) -> None:
    manifest = _manifest_of("sandbox", paused.sandbox_id)
    _lose_local_checkpoints(paused.sandbox_id)
    _drop_chunk_cache()
    state = next(f for f in manifest["files"] if f["path"] == "state")
    digest = next(d for d in state["chunks"] if d)
    chunk = REPOSITORY / "chunks" / digest[:2] / digest
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))

    with pytest.raises(SandboxException, match=r"(?i)corrupt|damaged|hash"):
        Sandbox.connect(paused.sandbox_id, timeout=60)
    assert Sandbox.get_info(paused.sandbox_id).state.value == "paused"


def test_snapshot_survives_losing_its_local_files() -> None:
    source = Sandbox.create(timeout=120)
    try:
        source.files.write("/home/user/snap.txt", "in the snapshot")
        info = source.create_snapshot(name="durable-snapshot")
    finally:
        source.kill()
    try:
        _manifest_of("template", info.snapshot_id)
        template_dir = Paths(HOME).templates / info.snapshot_id
        # The node records the copy's manifest a moment after storing it: its files are
        # expendable only from then on.
        _recorded(template_dir / "template.json")
        for build in template_dir.iterdir():
            if build.is_dir():
                shutil.rmtree(build)
        child = Sandbox.create(info.snapshot_id, timeout=60)
        try:
            assert child.files.read("/home/user/snap.txt") == "in the snapshot"
        finally:
            child.kill()
    finally:
        Sandbox.delete_snapshot(info.snapshot_id)
