"""Background uploads of snapshots to the repository when the snapshot goes away meanwhile:
the upload stops quietly, nothing of it stays in the repository, nothing fails unobserved."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.config import Config
from aenv.orchestrator.archive import Archive
from aenv.orchestrator.catalog import Catalog
from aenv.orchestrator.kinds import TemplateKind
from aenv.orchestrator.repository import open_archive
from aenv.orchestrator.saved import SavedStates
from aenv.orchestrator.templates import Template, TemplateStore
from aenv.runtime.qemu import QemuDriver


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[SavedStates]:
    config = Config(home=tmp_path)
    archive = open_archive(config)
    assert isinstance(archive, Archive)
    catalog = Catalog(config.paths.catalog)
    templates = TemplateStore(config.paths.templates, tmp_path / "memory")
    templates.load()
    try:
        yield SavedStates(
            catalog, templates, config.paths.sandboxes, archive, QemuDriver(), max_uploads=2
        )
    finally:
        archive.close()
        catalog.close()


def _snapshot(templates: TemplateStore) -> Template:
    directory = templates.directory / "snap1" / "build1"
    directory.mkdir(parents=True)
    (directory / "upper.qcow2").write_bytes(os.urandom(1 << 20))
    template = Template(
        template_id="snap1",
        build_id="build1",
        aliases=("mine",),
        cpu_count=1,
        memory_mb=256,
        disk_size_mb=1024,
        envd_version="0.1",
        envd_access_token="",
        created_at=time.time(),
        snapshot_dir=str(directory),
        kind=TemplateKind.SNAPSHOT,
    )
    templates.save(template)
    return template


async def test_a_snapshot_deleted_while_its_upload_runs(
    saved: SavedStates, caplog: pytest.LogCaptureFixture
) -> None:
    template = _snapshot(saved.templates)
    # What DELETE does when no sandbox uses it: hidden, then its files removed.
    saved.templates.hide(template.template_id)
    await saved.collect()
    assert not Path(template.snapshot_dir).exists()
    with caplog.at_level(logging.INFO, logger="aenv.orchestrator"):
        await saved.push_template(template)
    assert "it was deleted meanwhile" in caplog.text
    assert saved.archive is not None
    assert await saved.archive.repository.list_manifests() == []


async def test_a_failed_upload_of_a_kept_snapshot_is_logged(
    saved: SavedStates, caplog: pytest.LogCaptureFixture
) -> None:
    template = _snapshot(saved.templates)
    shutil.rmtree(template.snapshot_dir)  # lost under a snapshot that is still wanted
    with caplog.at_level(logging.WARNING, logger="aenv.orchestrator"):
        await saved.push_template(template)
    assert "upload of snap1 failed" in caplog.text
    current = saved.templates.by_id("snap1")
    assert current is not None and current.manifest_id is None
