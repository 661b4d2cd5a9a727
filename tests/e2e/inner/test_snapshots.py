"""Snapshots and fork with the unmodified SDK against real VMs: create, list, delete, create
from a snapshot, filesystem-only snapshots, and forks from a running sandbox, a paused one and a
snapshot."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2b import Sandbox

FORKS = 16


@pytest.fixture
def source() -> Iterator[Sandbox]:
    sbx = Sandbox.create(timeout=300, metadata={"role": "source"}, envs={"FROM": "source"})
    sbx.files.write("/home/user/base.txt", "prepared once")
    # Memory state: a variable in a long-running shell, readable through a fifo-free file.
    sbx.commands.run(
        "bash -c 'secret=$RANDOM$RANDOM; echo $secret > /tmp/secret; sleep 100000'",
        background=True,
    )
    sbx.commands.run("while [ ! -s /tmp/secret ]; do sleep 0.05; done", timeout=120)
    try:
        yield sbx
    finally:
        sbx.kill()


def _kill_all(children: list[Sandbox | Exception]) -> None:
    for child in children:
        if isinstance(child, Sandbox):
            child.kill()


def _check_children(children: list[Sandbox | Exception], source: Sandbox | None) -> None:
    sandboxes = [c for c in children if isinstance(c, Sandbox)]
    errors = [c for c in children if not isinstance(c, Sandbox)]
    assert not errors, errors
    assert len(sandboxes) == FORKS
    ids = {c.sandbox_id for c in sandboxes}
    assert len(ids) == FORKS and (source is None or source.sandbox_id not in ids)
    randoms = set()
    for i, child in enumerate(sandboxes):
        assert child.files.read("/home/user/base.txt") == "prepared once"
        child.files.write("/home/user/mine.txt", f"child {i}")
        randoms.add(child.commands.run("head -c 16 /dev/urandom | od -An -tx1").stdout)
    assert len(randoms) == FORKS  # fresh entropy in every child
    for i, child in enumerate(sandboxes):
        assert child.files.read("/home/user/mine.txt") == f"child {i}"  # nobody else's write
    if source is not None:
        assert not source.files.exists("/home/user/mine.txt")


def test_snapshot_create_list_delete_and_create_from_it(source: Sandbox) -> None:
    info = source.create_snapshot(name="prepared")
    assert info.snapshot_id and "prepared" in info.names
    assert source.is_running()  # the source keeps running
    source.files.write("/home/user/after.txt", "not in the snapshot")

    listed = {s.snapshot_id for s in Sandbox.list_snapshots().next_items()}
    assert info.snapshot_id in listed
    # The SDK types the instance form of this class-or-instance method as the class one.
    mine = source.list_snapshots().next_items()  # type: ignore[misc]
    assert [s.snapshot_id for s in mine] == [info.snapshot_id]

    child = Sandbox.create(info.snapshot_id, timeout=120)
    try:
        assert child.files.read("/home/user/base.txt") == "prepared once"
        assert not child.files.exists("/home/user/after.txt")
        # The shell started before the snapshot still runs in the restored memory.
        assert (
            child.commands.run("cat /tmp/secret").stdout
            == source.commands.run("cat /tmp/secret").stdout
        )
    finally:
        child.kill()
    by_name = Sandbox.create("prepared", timeout=60)
    by_name.kill()

    assert Sandbox.delete_snapshot(info.snapshot_id) is True
    assert Sandbox.delete_snapshot(info.snapshot_id) is False
    with pytest.raises(Exception, match="not found"):
        Sandbox.create(info.snapshot_id, timeout=60)


def test_snapshot_of_paused_sandbox(source: Sandbox) -> None:
    assert source.pause() is True
    info = Sandbox.create_snapshot(source.sandbox_id)
    try:
        assert Sandbox.get_info(source.sandbox_id).state.value == "paused"
        child = Sandbox.create(info.snapshot_id, timeout=60)
        assert child.files.read("/home/user/base.txt") == "prepared once"
        child.kill()
    finally:
        Sandbox.delete_snapshot(info.snapshot_id)


def test_filesystem_only_snapshot_cold_boots(source: Sandbox) -> None:
    info = source.create_snapshot(mode="filesystem")
    try:
        child = Sandbox.create(info.snapshot_id, timeout=120)
        try:
            assert child.files.read("/home/user/base.txt") == "prepared once"
            # Cold-booted: the source's processes are not there.
            assert child.commands.run("pgrep -x sleep || true").stdout == ""
        finally:
            child.kill()
    finally:
        Sandbox.delete_snapshot(info.snapshot_id)


def test_fork_running_sandbox(source: Sandbox) -> None:
    end_before = Sandbox.get_info(source.sandbox_id).end_at
    children = source.fork(count=FORKS, timeout=120)
    try:
        _check_children(children, source)
        first = children[0]
        assert isinstance(first, Sandbox)
        info = Sandbox.get_info(first.sandbox_id)
        assert info.metadata == {"role": "source"}
        assert first.commands.run("echo $FROM").stdout == "source\n"
        assert first.commands.run("echo $E2B_SANDBOX_ID").stdout.strip() == first.sandbox_id
        secret = source.commands.run("cat /tmp/secret").stdout
        assert first.commands.run("cat /tmp/secret").stdout == secret  # memory inherited
    finally:
        _kill_all(children)
    source_info = Sandbox.get_info(source.sandbox_id)
    assert source_info.state.value == "running" and source_info.end_at == end_before


def test_fork_paused_sandbox(source: Sandbox) -> None:
    assert source.pause() is True
    children = Sandbox.fork(source.sandbox_id, count=FORKS, timeout=120)
    try:
        _check_children(children, None)
        assert Sandbox.get_info(source.sandbox_id).state.value == "paused"
    finally:
        _kill_all(children)


def test_fork_from_snapshot_without_parent(source: Sandbox) -> None:
    info = source.create_snapshot()
    source.kill()
    try:
        children = Sandbox.fork(info.snapshot_id, count=FORKS, timeout=120)
        try:
            _check_children(children, None)
        finally:
            _kill_all(children)
    finally:
        Sandbox.delete_snapshot(info.snapshot_id)
