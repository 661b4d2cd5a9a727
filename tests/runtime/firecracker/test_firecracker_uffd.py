"""Firecracker's `Uffd` memory backend: a snapshot loaded on the Firecracker double, whose guest
memory the page-fault handler (`runtime/firecracker/uffd.py`) serves from a memory file fetched
on demand from a repository (`LazyFile`), as a node that lacks the file would. The double does
what Firecracker does (`fc_uffd.py`): a userfaultfd over anonymous memory, handed to the
handler's socket with the regions; its "vCPU" reads wait for the handler to fill each page."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

from aenv.runtime import driver as d
from aenv.runtime.firecracker import FirecrackerDriver
from aenv.runtime.firecracker import models as m
from aenv.runtime.firecracker.api import FirecrackerApi
from aenv.runtime.firecracker.uffd import UffdHandler
from aenv.runtime.firecracker.vm import UFFD_SOCKET, FirecrackerVM
from aenv.storage.repository import ChunkCache, MissingChunk, PosixStore, Repository
from aenv.storage.repository.lazy import LazyFile
from tests.runtime.firecracker.fc_peer import PAGE, PeerState
from tests.runtime.firecracker.fc_support import (
    alive,
    memory_elsewhere,
    page,
    pid_of,
    restore_target,
    touched,
)
from tests.support.wait import eventually


async def snapshot_elsewhere(peer: PeerState, tmp_path: Path) -> tuple[PosixStore, Path]:
    """A diff snapshot made on the double (its memory: the generation's page, holes around it),
    its memory file stored in a repository and gone from here; the double is then a fresh
    process, as a Firecracker on another node would be."""
    (tmp_path / "vmlinux").touch()
    async with FirecrackerApi(tmp_path / "api.sock") as api:
        config = m.MachineConfiguration(vcpu_count=1, mem_size_mib=1, track_dirty_pages=True)
        await api.put_machine_config(config)
        await api.put_boot_source(m.BootSource(kernel_image_path="vmlinux"))
        await api.start()
        await api.pause()
        params = m.SnapshotCreateParams(snapshot_path="s", mem_file_path="m", snapshot_type="Diff")
        await api.create_snapshot(params)
    (tmp_path / "saved").mkdir()
    os.replace(tmp_path / "m", tmp_path / "saved" / "m")
    peer.state, peer.config, peer.requests = "Not started", {}, []
    return PosixStore(tmp_path / "store"), tmp_path / "saved"


@asynccontextmanager
async def handler_over(
    store: PosixStore, saved: Path, tmp_path: Path, errors: list[Exception]
) -> AsyncIterator[tuple[UffdHandler, Repository]]:
    writer = Repository(store)
    try:
        manifest = await writer.put_tree(saved, name="memory")
    finally:
        writer.close()
    repo = Repository(store, ChunkCache(tmp_path / "cache", 1 << 30))
    lazy = LazyFile(repo, manifest, manifest.files[0], tmp_path / "lazy.mem")
    handler = UffdHandler(lazy, tmp_path / "uffd.sock", errors.append)
    handler.start(asyncio.get_running_loop())
    try:
        yield handler, repo
    finally:
        handler.close()
        lazy.close()
        repo.close()


async def load(tmp_path: Path) -> None:
    backend = m.MemoryBackend(backend_type="Uffd", backend_path="uffd.sock")
    async with FirecrackerApi(tmp_path / "api.sock") as api:
        await api.load_snapshot(
            m.SnapshotLoadParams(snapshot_path="s", mem_backend=backend, resume_vm=True)
        )


async def test_the_guest_memory_is_served_page_by_page(peer: PeerState, tmp_path: Path) -> None:
    store, saved = await snapshot_elsewhere(peer, tmp_path)
    errors: list[Exception] = []
    async with handler_over(store, saved, tmp_path, errors) as (handler, repo):
        await load(tmp_path)
        await eventually(lambda: len(peer.touched) == 2, "the guest read its two pages")
        assert peer.touched[PAGE] == b"1" * PAGE  # the page its snapshot held
        assert peer.touched[0] == bytes(PAGE)  # a hole: a zero page, no copy
        assert (handler.pages_copied, handler.pages_zeroed) == (1, 1)
        assert [(r.size, r.offset, r.page_size) for r in handler.regions] == [(1 << 20, 0, PAGE)]
        assert repo.stats.chunks_fetched == 1
        assert peer.memory is not None
        peer.memory.close()
    assert errors == []


async def test_a_page_no_source_gives_leaves_the_guest_waiting(
    peer: PeerState, tmp_path: Path
) -> None:
    store, saved = await snapshot_elsewhere(peer, tmp_path)
    errors: list[Exception] = []
    async with handler_over(store, saved, tmp_path, errors):
        for blob in (tmp_path / "store").glob("chunks/*/*"):
            blob.unlink()  # the memory's one chunk, lost
        await load(tmp_path)
        await eventually(lambda: bool(errors), "the handler reported the lost chunk")
        assert isinstance(errors[0], MissingChunk)
        assert peer.touched == {}  # the vCPU still waits: it read nothing, zeros least of all
        assert peer.memory is not None
        peer.memory.close()  # the VMM goes, as its owner stops it


# --- through the driver ---------------------------------------------------------------------------


def handler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aenv-uffd"]


async def test_a_restore_serves_memory_the_node_lacks(
    driver: FirecrackerDriver, spec: d.VMSpec, netns: str, tmp_path: Path
) -> None:
    async with memory_elsewhere(driver, spec, tmp_path) as (snap, lazy, repo, memory):
        errors: list[BaseException] = []
        target = replace(
            restore_target(tmp_path, "vm1", netns), lazy_memory=d.LazyMemory(lazy, errors.append)
        )
        vm = await driver.restore(snap, target)
        assert isinstance(vm, FirecrackerVM) and vm.uffd is not None
        try:
            seen = await touched(vm)
            assert seen == {0: page(memory, 0), PAGE: page(memory, 1)}
            assert seen[PAGE] == b"1" * PAGE  # the page its snapshot held; page 0 a hole
            assert (vm.uffd.pages_copied, vm.uffd.pages_zeroed) == (1, 1)
            assert repo.stats.chunks_fetched == 1
            socket = tmp_path / "vm1" / UFFD_SOCKET
            assert socket.exists()
            load = [
                r["body"]
                for r in (await vm.api._call("GET", "/_test/requests")).json()
                if r["path"] == "/snapshot/load"
            ]
            assert load[0]["mem_backend"] == {"backend_type": "Uffd", "backend_path": UFFD_SOCKET}
        finally:
            await vm.stop()
        assert vm.uffd is None and not socket.exists() and handler_threads() == []
        assert errors == []


async def test_a_page_no_source_gives_stops_the_vm(
    driver: FirecrackerDriver, spec: d.VMSpec, netns: str, tmp_path: Path
) -> None:
    async with memory_elsewhere(driver, spec, tmp_path) as (snap, lazy, _, _):
        for blob in (tmp_path / "store").glob("chunks/*/*"):
            blob.unlink()  # the memory's one stored chunk, lost
        errors: list[BaseException] = []
        target = replace(
            restore_target(tmp_path, "vm1", netns), lazy_memory=d.LazyMemory(lazy, errors.append)
        )
        try:
            vm = await driver.restore(snap, target)
        except d.RestoreError as error:  # the failure came before the restore returned
            assert "its memory could not be served" in str(error)
        else:
            assert isinstance(vm, FirecrackerVM)
            pid = pid_of(vm)
            await asyncio.wait_for(vm.wait_exit(), 60)
            await eventually(lambda: vm.state is d.VMState.STOPPED, "the VM stopped")
            assert isinstance(vm.memory_error, MissingChunk)
            assert not alive(pid) and vm.uffd is None
        await eventually(lambda: bool(errors), "the owner was told")
        assert isinstance(errors[0], MissingChunk)
        assert not (tmp_path / "vm1" / UFFD_SOCKET).exists() and handler_threads() == []


async def test_lazy_memory_is_refused_where_it_cannot_be_used(
    driver: FirecrackerDriver, spec: d.VMSpec, netns: str, tmp_path: Path
) -> None:
    async with memory_elsewhere(driver, spec, tmp_path) as (snap, lazy, _, _):
        target = replace(restore_target(tmp_path, "vm1", netns), lazy_memory=d.LazyMemory(lazy))
        try:
            await driver.boot_saved(snap, target)
        except d.BootError as error:
            assert "lazy_memory is for restores" in str(error)
        else:
            raise AssertionError("a boot took a memory source")
        small = replace(target, lazy_memory=d.LazyMemory(_Short(lazy)))
        try:
            await driver.restore(snap, small)
        except d.RestoreError as error:
            assert "the memory source has" in str(error)
        else:
            raise AssertionError("a short memory source was taken")


class _Short:
    """A memory source a page shorter than the guest's memory."""

    def __init__(self, source: LazyFile) -> None:
        self.source = source

    @property
    def size(self) -> int:
        return self.source.size - PAGE

    async def read(self, offset: int, length: int) -> bytes:
        return await self.source.read(offset, length)


class _Stalled:
    """A memory source whose reads never end (a source that hangs)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.reading = asyncio.Event()

    async def read(self, offset: int, length: int) -> bytes:
        self.reading.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_a_stop_while_a_page_is_awaited_ends_the_handler_quietly(
    driver: FirecrackerDriver, spec: d.VMSpec, netns: str, tmp_path: Path
) -> None:
    async with memory_elsewhere(driver, spec, tmp_path) as (snap, lazy, _, _):
        errors: list[BaseException] = []
        source = _Stalled(lazy.size)
        target = replace(
            restore_target(tmp_path, "vm1", netns), lazy_memory=d.LazyMemory(source, errors.append)
        )
        vm = await driver.restore(snap, target)
        assert isinstance(vm, FirecrackerVM)
        try:
            await asyncio.wait_for(source.reading.wait(), 30)  # the vCPU waits on its page
        finally:
            await asyncio.wait_for(vm.stop(), 60)  # the read under way is cut short
        assert vm.uffd is None and handler_threads() == []
        assert errors == [] and vm.memory_error is None
