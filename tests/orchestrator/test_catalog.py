import threading
import time
from pathlib import Path

import pytest

from aenv.orchestrator.catalog import Catalog, SandboxRecord
from aenv.orchestrator.states import SandboxState


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
        placement={"slot": 3},
    )


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    c = Catalog(tmp_path / "catalog.db")
    yield c
    c.close()


def test_roundtrip_keeps_every_field(catalog: Catalog) -> None:
    stored = catalog.insert(record("a" * 20))
    loaded = catalog.get("a" * 20)
    assert loaded == stored
    assert loaded is not None and loaded.metadata == {"k": "v"} and loaded.placement == {"slot": 3}


def test_transition_only_from_allowed_states(catalog: Catalog) -> None:
    catalog.insert(record("s1"))
    assert catalog.transition("s1", [SandboxState.RUNNING], SandboxState.KILLING) is None
    moved = catalog.transition("s1", [SandboxState.CREATING], SandboxState.RUNNING, end_at=5.0)
    assert moved is not None and moved.state is SandboxState.RUNNING and moved.end_at == 5.0
    assert catalog.transition("missing", [SandboxState.RUNNING], SandboxState.DEAD) is None
    with pytest.raises(ValueError):
        catalog.transition("s1", [SandboxState.RUNNING], SandboxState.RUNNING, bogus=1)


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
