import dataclasses
import random
import threading
import time
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.network.settings import SandboxNetwork
from aenv.orchestrator.catalog import (
    Archived,
    Catalog,
    PageQuery,
    RecordChanges,
    SandboxRecord,
)
from aenv.orchestrator.kinds import SaveMode
from aenv.orchestrator.states import KILLABLE, TRANSITIONS, IllegalTransition, SandboxState


def record(sandbox_id: str, started: float = 0.0) -> SandboxRecord:
    now = started or time.time()
    return SandboxRecord(
        id=sandbox_id,
        template_id="base",
        state=SandboxState.CREATING,
        cpu_count=1,
        memory_mb=512,
        disk_size_mb=1024,
        started_at=now,
        end_at=now + 300,
        metadata={"k": "v"},
        env_vars={"A": "1"},
        envd_access_token="tok",
        restored_from="/t/base/snapshot",
        timeout=120,
        auto_pause_mode=SaveMode.FILESYSTEM,
        checkpoint_seq=3,
        archived=Archived(2, "m-2"),
        network=SandboxNetwork(False, ("1.1.1.1",), ("8.8.8.0/24",), False, "${PORT}-x.test"),
    )


@pytest.fixture
def catalog(tmp_path: Path) -> Iterator[Catalog]:
    c = Catalog(tmp_path / "catalog.db")
    yield c
    c.close()


def test_roundtrip_keeps_every_field(catalog: Catalog) -> None:
    stored = catalog.insert(record("a" * 20))
    loaded = catalog.get("a" * 20)
    assert loaded == stored
    assert loaded is not None and loaded.metadata == {"k": "v"}
    assert loaded.archived == Archived(2, "m-2") and loaded.auto_pause_mode is SaveMode.FILESYSTEM


def test_transition_only_from_allowed_states(catalog: Catalog) -> None:
    catalog.insert(record("s1"))
    assert catalog.transition("s1", [SandboxState.RUNNING], SandboxState.KILLING) is None
    moved = catalog.transition("s1", [SandboxState.CREATING], SandboxState.RUNNING, end_at=5.0)
    assert moved is not None and moved.state is SandboxState.RUNNING and moved.end_at == 5.0
    assert catalog.transition("missing", [SandboxState.RUNNING], SandboxState.KILLING) is None
    with pytest.raises(ValueError):
        # A caller mypy does not check (mypy refuses this line) still meets the guard.
        catalog.transition("s1", [SandboxState.RUNNING], SandboxState.RUNNING, bogus=1)  # type: ignore[call-arg]


def test_concurrent_transitions_have_one_winner(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    setup = Catalog(path)
    setup.insert(record("race"))
    setup.transition("race", [SandboxState.CREATING], SandboxState.RUNNING)
    setup.close()
    winners: list[str] = []

    def contender(name: str) -> None:
        c = Catalog(path)
        if c.transition("race", [SandboxState.RUNNING], SandboxState.KILLING) is not None:
            winners.append(name)
        c.close()

    threads = [threading.Thread(target=contender, args=(str(i),)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1


def test_survives_reopen_and_lists_by_state(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    c = Catalog(path)
    c.insert(record("old", started=100.0))
    c.insert(record("new", started=200.0))
    c.transition("new", [SandboxState.CREATING], SandboxState.RUNNING)
    c.close()
    reopened = Catalog(path)
    assert [r.id for r in reopened.list()] == ["new", "old"]
    assert [r.id for r in reopened.list([SandboxState.CREATING])] == ["old"]
    assert reopened.count([SandboxState.RUNNING, SandboxState.CREATING]) == 2
    assert reopened.delete("old") and not reopened.delete("old")
    reopened.close()


def _paged(catalog: Catalog, query: PageQuery) -> list[str]:
    """Every page of `query` in turn, as a client following nextToken does."""
    ids: list[str] = []
    while True:
        page, more = catalog.page(query)
        ids += [r.id for r in page]
        if not more:
            assert len(page) <= query.limit
            return ids
        assert len(page) == query.limit
        query = dataclasses.replace(query, after=(page[-1].started_at, page[-1].id))


def test_pages_match_filtering_everything_in_python(catalog: Catalog) -> None:
    rng = random.Random(7)
    states = [SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.CREATING]
    for n in range(300):
        catalog.insert(
            dataclasses.replace(
                record(f"s{n:03d}", started=1000.0 + rng.randrange(60)),  # many equal times
                state=rng.choice(states),
                template_id=rng.choice(["t1", "t2"]),
                alias=rng.choice([None, "web"]),
                metadata={"team": rng.choice(["a", "b"]), "odd key=&": str(n % 3)},
            )
        )
    everything = catalog.list()
    running = frozenset({SandboxState.RUNNING})
    cases = [
        PageQuery(states=running | {SandboxState.PAUSED}, limit=7),
        PageQuery(states=running, limit=10, ascending=True),
        PageQuery(states=running, limit=3, metadata={"team": "a", "odd key=&": "1"}),
        PageQuery(states=running | {SandboxState.PAUSED}, limit=50, template="web"),
        PageQuery(states=running, limit=4, template="t2", started_after=1030.0),
        PageQuery(states=running, limit=100, metadata={"team": "nobody"}),
    ]
    for query in cases:
        wanted = [
            r
            for r in everything
            if r.state in query.states
            and all(r.metadata.get(k) == v for k, v in query.metadata.items())
            and (query.template is None or query.template in (r.template_id, r.alias))
            and (query.started_after is None or r.started_at > query.started_after)
        ]
        wanted.sort(key=lambda r: (r.started_at, r.id), reverse=not query.ascending)
        assert _paged(catalog, query) == [r.id for r in wanted], query


def test_pages_leave_out_the_servers_own_sandboxes(catalog: Catalog) -> None:
    running = dataclasses.replace(record("user-sbx"), state=SandboxState.RUNNING)
    build_vm = dataclasses.replace(record("build-vm"), state=SandboxState.RUNNING, internal=True)
    catalog.insert(running)
    catalog.insert(build_vm)
    page, more = catalog.page(PageQuery(states=frozenset({SandboxState.RUNNING}), limit=10))
    assert [r.id for r in page] == ["user-sbx"] and not more
    assert catalog.get("build-vm") is not None  # still there, only not listed


def test_moves_outside_the_transition_table_raise(catalog: Catalog) -> None:
    catalog.insert(record("s2"))
    with pytest.raises(IllegalTransition, match="creating to paused"):
        catalog.transition("s2", [SandboxState.CREATING], SandboxState.PAUSED)
    with pytest.raises(IllegalTransition, match="killing"):
        catalog.transition("s2", KILLABLE | {SandboxState.KILLING}, SandboxState.RUNNING)
    stored = catalog.get("s2")
    assert stored is not None and stored.state is SandboxState.CREATING  # nothing written
    # Staying in a state changes fields only, from any state.
    assert catalog.update("s2", end_at=9.0) is not None


def test_every_state_is_reachable_and_can_be_killed() -> None:
    reached = {SandboxState.CREATING}
    frontier = [SandboxState.CREATING]
    while frontier:
        for nxt in TRANSITIONS[frontier.pop()]:
            if nxt not in reached:
                reached.add(nxt)
                frontier.append(nxt)
    assert reached == set(SandboxState)
    assert frozenset(SandboxState) - KILLABLE == {SandboxState.KILLING}


def test_network_settings_change(catalog: Catalog) -> None:
    catalog.insert(record("s3"))
    changed = SandboxNetwork(deny_out=("0.0.0.0/0",), allow_out=("9.9.9.9", "*.example.com"))
    updated = catalog.update("s3", network=changed)
    assert updated is not None and updated.network == changed
    assert catalog.get("s3") == updated


def test_record_changes_are_the_record_fields_but_its_key_and_state() -> None:
    # The typed changes of a transition stay the record's own fields, with the same types:
    # a field added to the record is changeable, and typed, only through this list.
    record_types = typing.get_type_hints(SandboxRecord)
    change_types = typing.get_type_hints(RecordChanges)
    assert set(record_types) - set(change_types) == {"id", "state", "updated_at"}
    assert all(change_types[name] == record_types[name] for name in change_types)
