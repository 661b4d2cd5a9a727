"""E2B parity seen from the unmodified SDK against real VMs (issue 15): the guest resolves its
own name after create, fork and resume; set_timeout(0) pauses a sandbox whose lifecycle says
so; a create retried with one idempotency key starts one sandbox; fields the node does not
implement are refused by name; metrics are kept over time and while paused."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest
from e2b import Sandbox, SandboxException, SandboxQuery

RESOLVES = "getent hosts $(hostname) && sudo -n true 2>&1"


def _resolves_its_name(sandbox: Sandbox) -> None:
    result = sandbox.commands.run(RESOLVES, user="root")
    assert sandbox.sandbox_id in result.stdout
    assert "unable to resolve" not in result.stdout + result.stderr


def test_the_guest_resolves_its_own_name_after_create_fork_and_resume() -> None:
    sandbox = Sandbox.create(timeout=120)
    children: list[Sandbox] = []
    try:
        _resolves_its_name(sandbox)
        # fork() lists an exception in place of a child that failed: none may here.
        for child in sandbox.fork(count=1, timeout=120):
            assert isinstance(child, Sandbox), child
            children.append(child)
        _resolves_its_name(children[0])
        sandbox.pause()
        resumed = Sandbox.connect(sandbox.sandbox_id, timeout=120)
        _resolves_its_name(resumed)
    finally:
        for s in [sandbox, *children]:
            s.kill()


def test_set_timeout_zero_pauses_when_the_lifecycle_says_pause() -> None:
    sandbox = Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause"})
    try:
        sandbox.files.write("/home/user/kept", "before the timeout")
        sandbox.set_timeout(0)
        deadline = time.monotonic() + 120
        while Sandbox.get_info(sandbox.sandbox_id).state.value != "paused":
            if time.monotonic() > deadline:
                pytest.fail("set_timeout(0) did not pause the sandbox")
            time.sleep(0.5)
        resumed = Sandbox.connect(sandbox.sandbox_id, timeout=120)
        assert resumed.files.read("/home/user/kept") == "before the timeout"
    finally:
        sandbox.kill()


def test_twenty_concurrent_retries_with_one_key_start_one_sandbox() -> None:
    def create(_: int) -> str:
        made = Sandbox.create(timeout=120, metadata={"idem": "1"}, idempotency_key="idem-e2e-1")
        return made.sandbox_id

    with ThreadPoolExecutor(20) as pool:
        ids = set(pool.map(create, range(20)))
    listed = Sandbox.list(query=SandboxQuery(metadata={"idem": "1"})).next_items()
    try:
        assert len(ids) == 1 and [s.sandbox_id for s in listed] == list(ids)
    finally:
        for s in listed:
            Sandbox.kill(s.sandbox_id)


def test_unimplemented_fields_are_refused_by_name() -> None:
    with pytest.raises(SandboxException, match="'mcp' is not supported here"):
        Sandbox.create(mcp={"exa": {"apiKey": "x"}})
    with pytest.raises(SandboxException, match="volume 'no-such-volume' not found"):
        Sandbox.create(volume_mounts={"/mnt/data": "no-such-volume"})


def test_metrics_history_by_range_and_while_paused() -> None:
    sandbox = Sandbox.create(timeout=120)
    try:
        created = datetime.now(UTC) - timedelta(seconds=5)
        deadline = time.monotonic() + 120
        while len(sandbox.get_metrics(start=created)) < 2:  # sampled every 5 s
            if time.monotonic() > deadline:
                pytest.fail("no history after 2 minutes")
            time.sleep(1)
        past = created - timedelta(hours=1)
        assert sandbox.get_metrics(start=past, end=past + timedelta(minutes=1)) == []
        sandbox.pause()
        kept = Sandbox.get_metrics(sandbox.sandbox_id, start=created)
        assert len(kept) >= 2 and all(m.mem_used > 0 for m in kept)
        stamps = [m.timestamp for m in kept]
        assert stamps == sorted(stamps)
    finally:
        sandbox.kill()
