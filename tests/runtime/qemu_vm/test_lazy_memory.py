"""Memory on demand in a real restore: the template snapshot's memory file stored in a
repository, and a VM restored, jailed as every VMM, from a snapshot whose memory file is that
copy served lazily on a FUSE mount (`storage/fusefile.py`), as a node that lacks the file would
restore it. The guest answers with what it held before its snapshot, and only the chunks its
pages touched were fetched."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from aenv.runtime.driver import VMState
from aenv.storage.fusefile import FuseFile
from aenv.storage.repository import ChunkCache, PosixStore, Repository
from aenv.storage.repository.lazy import LazyFile
from tests.runtime.qemu_vm.conftest import TEMPLATE_MEMORY, TEMPLATE_NOTE, Fleet, Template
from tests.runtime.qemu_vm.netns import agent

pytestmark = pytest.mark.slow


async def test_a_restore_whose_memory_comes_as_it_is_touched(
    fleet: Fleet, template: Template, tmp_path: Path
) -> None:
    memory = template.snapshot.memory_file
    assert memory is not None
    store = PosixStore(tmp_path / "store")
    writer = Repository(store)
    try:
        manifest = await writer.put_tree(memory.parent, name="template memory")
    finally:
        writer.close()
    entry = next(f for f in manifest.files if f.path == memory.name)
    repo = Repository(store, ChunkCache(tmp_path / "cache", 1 << 30))
    lazy = LazyFile(repo, manifest, entry, tmp_path / "lazy.mem")
    fuse = FuseFile(lazy, memory.name)
    (tmp_path / "mnt").mkdir()
    fuse.mount(tmp_path / "mnt", asyncio.get_running_loop())
    try:
        remote = dataclasses.replace(template.snapshot, memory_file=fuse.path)
        vm, netns = await fleet.restore(remote)
        assert vm.state is VMState.RUNNING
        state = await agent(netns)
        assert (state["memory"], state["note"]) == (TEMPLATE_MEMORY, TEMPLATE_NOTE)
        stored = sum(d is not None for d in entry.chunks)
        fetched = repo.stats.chunks_fetched
        print(f"fetched {fetched} of {stored} stored chunks ({entry.size >> 20} MiB file)")
        assert 0 < fetched < stored  # what the guest touched to answer, not the whole file
        await vm.stop()
    finally:
        fuse.unmount()
        lazy.close()
        repo.close()
