"""Saved states on the double driver: snapshots, forks (some children failing), start-up after
a crash mid-pause or before a pause's upload, and what goes from the local disk and the
snapshot repository when."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from aenv.orchestrator import checkpoints
from aenv.orchestrator.kinds import SaveMode, TemplateKind
from aenv.orchestrator.lifecycle import CreateFailed, InvalidState, OperationFailed
from aenv.orchestrator.states import SandboxState
from aenv.runtime.driver import Snapshot
from tests.doubles.node import (
    DoubleNode,
    assert_clean,
    double_node,
    resumed_with_a_copy,
)
from tests.support.wait import eventually


async def test_fork_where_some_children_fail(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        parent, _ = await node.orchestrator.create(node.request(metadata={"who": "parent"}))
        node.guest(parent.id).write("/state", "forked")
        node.driver.fail_next("restore")  # one of the three children
        children = await node.orchestrator.fork(parent.id, 3, 60)
        started = [c for c in children if not isinstance(c, BaseException)]
        failed = [c for c in children if isinstance(c, BaseException)]
        assert len(started) == 2 and len(failed) == 1
        assert isinstance(failed[0], CreateFailed)
        forks = [t for t in node.templates.list_all() if t.kind is TemplateKind.FORK]
        assert len(forks) == 1
        for child in started:
            assert child.state is SandboxState.RUNNING and child.metadata == {"who": "parent"}
            guest = node.guest(child.id)
            assert guest.read("/state") == "forked" and guest.hostname == child.id
            assert child.restored_from == forks[0].snapshot_dir
        # The failed child left no row; the parent runs on.
        assert {r.id for r in node.catalog.list()} == {parent.id, *(c.id for c in started)}
        assert node.orchestrator.get(parent.id).state is SandboxState.RUNNING
        # The checkpoint goes with its last child.
        await node.orchestrator.kill(started[0].id)
        assert Path(forks[0].snapshot_dir).exists()
        await node.orchestrator.kill(started[1].id)
        assert node.templates.by_id(forks[0].template_id) is None
        assert not Path(forks[0].snapshot_dir).exists()


async def test_startup_after_a_half_written_pause(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        node.guest(record.id).write("/kept", "first pause")
        await node.orchestrator.pause(record.id)
        await node.orchestrator.resume(record.id, 60)
        node.guest(record.id).write("/kept", "lost with the crash")
        held = node.driver.hold("snapshot")
        pause = asyncio.create_task(node.orchestrator.pause(record.id))
        await held.reached.wait()
        # The server dies here: the second checkpoint's directory exists, it is incomplete, the
        # row says PAUSING, and the VMM goes with the server (the start-up sweep kills it).
        pause.cancel()
        await asyncio.gather(pause, return_exceptions=True)
        sandbox_dir = node.config.paths.sandboxes / record.id
        assert (checkpoints.pause_dir(sandbox_dir, 2)).is_dir()
        assert node.row(record.id).state is SandboxState.PAUSING
        for vm in list(node.driver.running.values()):
            await vm.stop()
        for slot in list(node.slots.in_use.values()):
            await node.slots.release(slot)

        restarted = node.reopen()
        await restarted.orchestrator.start()
        row = restarted.row(record.id)
        assert (row.state, row.checkpoint_seq) == (SandboxState.PAUSED, 1)
        assert not checkpoints.pause_dir(sandbox_dir, 2).exists()
        await restarted.orchestrator.resume(record.id, 60)
        assert restarted.guest(record.id).read("/kept") == "first pause"
        await restarted.orchestrator.close()
        restarted.catalog.close()
        assert_clean(restarted)


async def test_startup_uploads_a_checkpoint_a_crash_kept_from_the_repository(
    tmp_path: Path,
) -> None:
    """A kill -9 after a pause returned but before its upload ended (during its detach or
    merge, or the upload itself): the restart uploads that checkpoint, over what the cut
    upload had staged, and a resume can fall back to the copy."""
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        node.guest(record.id).write("/kept", "paused")
        held = node.driver.hold("export")
        await node.orchestrator.pause(record.id)
        await held.reached.wait()
        # The server dies here: no copy, and the upload's staging directory stays.
        await node.orchestrator.saved.cancel_push(record.id)
        staging = checkpoints.archive_dir(node.config.paths.sandboxes / record.id, 1)
        staging.mkdir()
        (staging / "state").write_text("half-staged")
        assert node.row(record.id).archived is None

        restarted = node.reopen()
        await restarted.orchestrator.start()
        await eventually(lambda: restarted.row(record.id).archived is not None)
        archived = restarted.row(record.id).archived
        assert archived is not None and archived.seq == 1
        assert not staging.exists()
        restarted.driver.fail_next("restore")  # the local checkpoint: the copy is restored
        await restarted.orchestrator.resume(record.id, 60)
        assert restarted.guest(record.id).read("/kept") == "paused"
        assert await restarted.orchestrator.kill(record.id)
        await restarted.orchestrator.close()
        restarted.catalog.close()
        assert_clean(restarted)


async def _paused_twice_second_copy_missing(node: DoubleNode) -> str:
    """A sandbox paused twice ("one", then "two") whose second checkpoint has no repository
    copy (its upload never ran) while the first's copy is still there."""
    sandbox_id = await resumed_with_a_copy(node)
    held = node.driver.hold("export")
    await node.orchestrator.pause(sandbox_id)
    await held.reached.wait()
    await node.orchestrator.saved.cancel_push(sandbox_id)
    archived = node.row(sandbox_id).archived
    assert archived is not None and (archived.seq, node.row(sandbox_id).checkpoint_seq) == (1, 2)
    return sandbox_id


async def test_a_lost_checkpoint_is_not_replaced_by_an_older_one(tmp_path: Path) -> None:
    """The newest checkpoint is gone from the disk and the repository holds only the one
    before it: the resume fails saying so, and the sandbox stays paused at its checkpoint
    (before, it came back with "one" without a word)."""
    async with double_node(tmp_path) as node:
        sandbox_id = await _paused_twice_second_copy_missing(node)
        shutil.rmtree(checkpoints.pause_dir(node.config.paths.sandboxes / sandbox_id, 2))
        with pytest.raises(OperationFailed, match="only checkpoint 1, an older state"):
            await node.orchestrator.resume(sandbox_id, 60)
        row = node.row(sandbox_id)
        assert (row.state, row.checkpoint_seq) == (SandboxState.PAUSED, 2)
        assert node.driver.running == {} and node.slots.in_use == {}
        assert await node.orchestrator.kill(sandbox_id)


async def test_a_corrupt_checkpoint_resumes_from_its_copy(tmp_path: Path) -> None:
    """A byte of a paused sandbox's checkpoint changed after its copy reached the repository:
    the resume refuses the local files (their checksums) and restores the copy, with what the
    sandbox had, rather than the changed byte."""
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        node.guest(record.id).write("/data", "before the pause")
        await node.orchestrator.pause(record.id)
        await eventually(lambda: node.row(record.id).archived is not None)
        checkpoint = checkpoints.pause_dir(node.config.paths.sandboxes / record.id, 1)
        files = Snapshot.load_manifest(checkpoint).files().values()
        path = next(p for p in files if b"before the pause" in p.read_bytes())
        path.write_bytes(path.read_bytes().replace(b"before the pause", b"bEfore the pause"))
        await node.orchestrator.resume(record.id, 60)
        assert node.guest(record.id).read("/data") == "before the pause"


async def test_a_checkpoint_changed_before_its_upload_is_not_uploaded(tmp_path: Path) -> None:
    """A byte of a paused sandbox's checkpoint changed before its upload read it: the upload
    refuses it rather than storing the change as the sandbox's state, so the resume refuses
    the checkpoint too instead of restoring the changed byte from the copy."""
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        node.guest(record.id).write("/data", "before the pause")
        upload = node.driver.hold("export")
        await node.orchestrator.pause(record.id)
        await upload.reached.wait()
        checkpoint = checkpoints.pause_dir(node.config.paths.sandboxes / record.id, 1)
        files = Snapshot.load_manifest(checkpoint).files().values()
        path = next(p for p in files if b"before the pause" in p.read_bytes())
        path.write_bytes(path.read_bytes().replace(b"before the pause", b"bEfore the pause"))
        upload.release()
        await node.orchestrator.saved.wait_push(record.id)
        assert node.row(record.id).archived is None
        with pytest.raises(OperationFailed, match=r"is corrupt: file .* checksum mismatch"):
            await node.orchestrator.resume(record.id, 60)
        assert node.row(record.id).state is SandboxState.PAUSED


async def test_startup_keeps_a_checkpoint_whose_files_are_gone_but_copied(tmp_path: Path) -> None:
    """A paused sandbox's files are gone from the disk (a replaced disk, say) but its
    checkpoint is in the repository: the restart keeps it paused, and it resumes from the
    copy. One whose newest checkpoint is gone and has no copy, only the copy of the one
    before: it stays paused, at the checkpoint its row names, and cannot be resumed (rather
    than coming back older, or vanishing)."""
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        node.guest(record.id).write("/data", "copied")
        await node.orchestrator.pause(record.id)
        await eventually(lambda: node.row(record.id).archived is not None)
        older = await _paused_twice_second_copy_missing(node)
        sandboxes = node.config.paths.sandboxes
        shutil.rmtree(sandboxes / record.id)
        shutil.rmtree(checkpoints.pause_dir(sandboxes / older, 2))

        restarted = node.reopen()
        await restarted.orchestrator.start()
        for sandbox_id, seq in ((record.id, 1), (older, 2)):
            row = restarted.row(sandbox_id)
            assert (row.state, row.checkpoint_seq) == (SandboxState.PAUSED, seq)
        await restarted.orchestrator.resume(record.id, 60)
        assert restarted.guest(record.id).read("/data") == "copied"
        with pytest.raises(OperationFailed, match="an older state"):
            await restarted.orchestrator.resume(older, 60)
        for sandbox_id in (record.id, older):
            assert await restarted.orchestrator.kill(sandbox_id)
        await restarted.orchestrator.close()
        restarted.catalog.close()
        assert_clean(restarted)


async def test_uploads_wait_for_a_free_slot(tmp_path: Path) -> None:
    """Past `max_concurrent_uploads`, checkpoint uploads queue (a restart or a burst of pauses
    would otherwise spend every core exporting) and each still ends with its copy."""
    async with double_node(tmp_path, max_concurrent_uploads=1) as node:
        first, _ = await node.orchestrator.create(node.request())
        second, _ = await node.orchestrator.create(node.request())
        held = node.driver.hold("export")
        try:
            await node.orchestrator.pause(first.id)
            await held.reached.wait()
            await node.orchestrator.pause(second.id)
            await asyncio.sleep(0.3)  # time for it to reach the export, were it let
            assert node.driver.calls["export"] == 1  # the second waits for the slot
            assert node.row(second.id).archived is None
        finally:
            held.release()
        await eventually(lambda: all(node.row(r.id).archived for r in (first, second)))
        assert node.driver.calls["export"] == 2
        await node.orchestrator.resume(second.id, 60)


async def test_restart_reclaims_sandboxes_that_were_running(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        for vm in list(node.driver.running.values()):
            await vm.stop()  # the server and its VMMs die together
        for slot in list(node.slots.in_use.values()):
            await node.slots.release(slot)
        restarted = node.reopen()
        await restarted.orchestrator.start()
        assert restarted.catalog.get(record.id) is None
        assert not (node.config.paths.sandboxes / record.id).exists()
        await restarted.orchestrator.close()
        restarted.catalog.close()


async def test_snapshot_outlives_its_sandbox_and_restores(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        node.guest(record.id).write("/app", "v1")
        snap = await node.orchestrator.snapshot(record.id, name="mine")
        assert snap.kind is TemplateKind.SNAPSHOT and snap.save_mode is SaveMode.FULL
        assert node.orchestrator.get(record.id).state is SandboxState.RUNNING  # kept running
        await node.orchestrator.kill(record.id)
        child, template = await node.orchestrator.create(node.request(template="mine"))
        assert template.template_id == snap.template_id
        assert node.guest(child.id).read("/app") == "v1"


async def test_filesystem_snapshot_of_a_memory_pause_is_refused(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        await node.orchestrator.pause(record.id)
        templates = {t.template_id for t in node.templates.list_all()}
        with pytest.raises(InvalidState, match="resume it first"):
            await node.orchestrator.snapshot(record.id, mode=SaveMode.FILESYSTEM)
        assert {t.template_id for t in node.templates.list_all()} == templates
        assert node.orchestrator.get(record.id).state is SandboxState.PAUSED


async def test_repository_copies_go_with_what_they_copy(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        archive = node.orchestrator.saved.archive
        assert archive is not None
        record, _ = await node.orchestrator.create(node.request())
        await node.orchestrator.pause(record.id)
        await eventually(lambda: node.row(record.id).archived is not None)
        first = node.row(record.id).archived
        await node.orchestrator.resume(record.id, 60)
        await node.orchestrator.pause(record.id)
        await eventually(lambda: node.row(record.id).archived not in (None, first))
        manifests = {m.id for m in await archive.repository.list_manifests()}
        assert first is not None and first.manifest not in manifests  # replaced by the newer

        snap = await node.orchestrator.snapshot(record.id, name="kept")
        await eventually(
            lambda: (node.templates.by_id(snap.template_id) or snap).manifest_id is not None
        )
        stored = node.templates.by_id(snap.template_id)
        assert stored is not None and stored.manifest_id is not None
        await node.orchestrator.kill(record.id)
        manifests = {m.id for m in await archive.repository.list_manifests()}
        assert manifests == {stored.manifest_id}  # the killed sandbox's copy went

        await node.orchestrator.delete_template(snap.template_id)
        assert await archive.repository.list_manifests() == []
        report = await archive.repository.gc(grace=0)
        assert report.chunks_deleted > 0 and report.chunks_referenced == 0
        assert_clean(node)


async def test_a_snapshot_keeps_its_memory_on_tmpfs_and_in_its_repository_copy(
    tmp_path: Path,
) -> None:
    """A snapshot's memory file lives beside the templates' (tmpfs), outside its directory: the
    repository copy carries it all the same, so a node that lost both restores from the copy;
    a newer build under the same name takes the older build's memory with it."""
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        node.guest(record.id).write("/state", "snapped")
        first = await node.orchestrator.snapshot(record.id, name="kept")
        first_memory = node.templates.build_memory_dir(first.template_id, first.build_id)
        saved = first.snapshot()
        assert saved.memory_file == first_memory / "memory"
        assert saved.memory_file.parent != Path(first.snapshot_dir)
        snap = await node.orchestrator.snapshot(record.id, name="kept")
        assert snap.template_id == first.template_id and not first_memory.exists()
        await eventually(
            lambda: (node.templates.by_id(snap.template_id) or snap).manifest_id is not None
        )
        await node.orchestrator.kill(record.id)
        shutil.rmtree(snap.snapshot_dir)
        shutil.rmtree(node.templates.build_memory_dir(snap.template_id, snap.build_id))
        child, _ = await node.orchestrator.create(node.request(template="kept"))
        assert node.guest(child.id).read("/state") == "snapped"
        await node.orchestrator.kill(child.id)


async def test_a_crash_mid_snapshot_leaves_no_memory_file_behind(tmp_path: Path) -> None:
    """kill -9 of the server while a new build of a named snapshot is written: after the
    restart, the half-written build (its directory, and its memory file on tmpfs) is gone and
    the previous build still restores."""
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        node.guest(record.id).write("/state", "first")
        first = await node.orchestrator.snapshot(record.id, name="kept")
        await eventually(  # its upload, which stages a copy beside it, is over
            lambda: (node.templates.by_id(first.template_id) or first).manifest_id is not None
        )
        node.guest(record.id).write("/state", "lost with the crash")
        held = node.driver.hold("snapshot")
        second = asyncio.create_task(node.orchestrator.snapshot(record.id, name="kept"))
        try:
            await held.reached.wait()
            builds = node.templates.directory / first.template_id
            (partial,) = [
                b for b in builds.iterdir() if b.is_dir() and str(b) != first.snapshot_dir
            ]
            memory = node.templates.build_memory_dir(first.template_id, partial.name)
            (memory / "memory").write_text("what the save had written when the server died")
            # The server dies here: nothing of it runs on, its VMMs go with it.
            for vm in list(node.driver.running.values()):
                await vm.stop()
            for slot in list(node.slots.in_use.values()):
                await node.slots.release(slot)
            restarted = node.reopen()
            await restarted.orchestrator.start()
            try:
                assert not partial.exists() and not memory.exists()
                child, _ = await restarted.orchestrator.create(restarted.request(template="kept"))
                assert restarted.guest(child.id).read("/state") == "first"
                await restarted.orchestrator.kill(child.id)
            finally:
                await restarted.orchestrator.close()
                restarted.catalog.close()
        finally:
            second.cancel()  # the dead server's task, which never ran on
            await asyncio.gather(second, return_exceptions=True)


async def test_a_save_whose_memory_dir_cannot_be_made_leaves_no_build(tmp_path: Path) -> None:
    """Each directory of a save is undone once made: the build's directory, made first, goes
    when its memory directory (tmpfs) cannot be made, and the sandbox runs on."""
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        # Where the template's memory directories would go is a file.
        (node.templates.memory_dir / "blocked").write_text("")
        with pytest.raises(OSError):
            await node.orchestrator.save_template(record.id, "blocked", TemplateKind.TEMPLATE, ())
        builds = node.templates.directory / "blocked"
        assert not builds.exists() or list(builds.iterdir()) == []
        assert node.row(record.id).state is SandboxState.RUNNING
        assert node.guest(record.id).read("/etc/template") == "base"


async def test_a_snapshot_deleted_while_it_uploads_goes_when_the_upload_ends(
    tmp_path: Path,
) -> None:
    """`collect` keeps a template while its upload's staging is pinned; the last sandbox
    on a deleted snapshot ending mid-upload must not leave its files until some later end."""
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        saved = node.orchestrator.saved
        slots = saved._upload_slots  # every upload waits for one: held, the push stays pinned
        for _ in range(node.config.max_concurrent_uploads):
            await slots.acquire()
        snap = await node.orchestrator.snapshot(record.id, name="uploading")
        directory = Path(node.templates.get(snap.template_id).snapshot_dir)
        child, _ = await node.orchestrator.create(node.request(template=snap.template_id))
        await node.orchestrator.delete_template(snap.template_id)
        assert await node.orchestrator.kill(child.id)
        assert directory.exists()  # its upload is under way
        for _ in range(node.config.max_concurrent_uploads):
            slots.release()
        await eventually(lambda: not directory.parent.exists(), "the deleted snapshot collected")
        assert node.templates.by_id(snap.template_id) is None
