"""A node's data is out of reach of other local users: checked as `nobody`, with the node's
own writers (catalog, template store, API key) and a home an older node left world-readable."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.api.keys import open_keys
from aenv.config import Config
from aenv.orchestrator.catalog import Catalog, SandboxRecord
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.templates import Template, TemplateStore
from aenv.server import _private_dirs
from aenv.storage.private import make_private

NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
TOKEN = "envd-token-that-must-stay-secret"


def _nobody_reads(path: Path) -> bool:
    return subprocess.run([*NOBODY, "cat", str(path)], capture_output=True).returncode == 0


@pytest.fixture
def home() -> Iterator[Path]:
    """A data directory whose parent any user may enter (pytest's own temp dirs are 0700)."""
    parent = Path(tempfile.mkdtemp(prefix="aenv-private-"))
    parent.chmod(0o755)
    try:
        yield parent / "home"
    finally:
        shutil.rmtree(parent)
        shutil.rmtree(Config(home=parent / "home").paths.memory, ignore_errors=True)


def _write_node_files(config: Config) -> list[Path]:
    """What a node writes that holds secrets, written by the node's own code."""
    key_path = config.paths.api_key
    open_keys(config.paths)
    catalog = Catalog(config.paths.catalog)
    catalog.insert(
        SandboxRecord(
            id="a" * 20,
            template_id="base",
            alias=None,
            state=SandboxState.RUNNING,
            cpu_count=1,
            memory_mb=256,
            disk_size_mb=1024,
            started_at=time.time(),
            end_at=time.time() + 60,
            metadata={},
            env_vars={"SECRET": "value"},
            envd_access_token=TOKEN,
        )
    )
    store = TemplateStore(config.paths.templates, config.paths.memory)
    (store.directory / "base").mkdir(parents=True)
    store.save(_template(config))
    memory = config.paths.memory / "base" / "memory"
    memory.parent.mkdir(parents=True)
    memory.write_bytes(b"guest RAM")  # created as a VMM creates it: 0644
    wal = config.home / "catalog.db-wal"
    assert wal.exists()  # open: the WAL holds the row
    files = [key_path, config.paths.catalog, wal, config.paths.templates / "base" / "template.json"]
    files.append(config.paths.api_keys)
    return [*files, memory]


def _template(config: Config) -> Template:
    return Template(
        template_id="base",
        build_id="b1",
        aliases=(),
        cpu_count=1,
        memory_mb=256,
        disk_size_mb=1024,
        envd_version="0.1",
        envd_access_token=TOKEN,
        created_at=time.time(),
        snapshot_dir=str(config.paths.templates / "base" / "b1"),
    )


def test_nobody_reads_a_node_s_secrets(home: Path) -> None:
    config = Config(home=home)
    make_private(*_private_dirs(config))
    files = _write_node_files(config)
    leaked = [path for path in files if _nobody_reads(path)]
    assert leaked == []
    for path in files[:4]:  # the node's own secret files are private by mode too
        assert path.stat().st_mode & 0o077 == 0, path


def test_a_world_readable_home_is_made_private(home: Path) -> None:
    config = Config(home=home)
    home.mkdir(mode=0o755)
    config.paths.memory.mkdir(mode=0o755)
    files = _write_node_files(config)
    (home / "catalog.db").chmod(0o644)  # as an older node left them
    (home / "catalog.db-wal").chmod(0o644)
    assert _nobody_reads(files[-1])  # the test can see a leak
    make_private(*_private_dirs(config))
    Catalog(config.paths.catalog).close()
    assert [path for path in files if _nobody_reads(path)] == []
    assert (home / "catalog.db-wal").stat().st_mode & 0o077 == 0
