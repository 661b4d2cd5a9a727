"""The template store's changes from several threads at once (its saves run in worker
threads): each change is made of the record as stored when it is written, so none is lost."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

from aenv.orchestrator.templates import TEMPLATE_FILE, TemplateStore
from tests.orchestrator.test_saved_push import _snapshot

ROUNDS = 200


def test_changes_from_two_threads_at_once_all_stay(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path / "templates", tmp_path / "memory")
    store.load()
    first = _snapshot(store)

    def grow(field: str) -> None:
        for _ in range(ROUNDS):
            store.update(
                first.template_id,
                lambda t: dataclasses.replace(t, **{field: getattr(t, field) + 1}),
            )

    threads = [threading.Thread(target=grow, args=(f,)) for f in ("cpu_count", "memory_mb")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stored = store.by_id(first.template_id)
    assert stored is not None
    assert (stored.cpu_count, stored.memory_mb) == (
        first.cpu_count + ROUNDS,
        first.memory_mb + ROUNDS,
    )
    written = json.loads((store.directory / first.template_id / TEMPLATE_FILE).read_text())
    assert (written["cpu_count"], written["memory_mb"]) == (stored.cpu_count, stored.memory_mb)


def test_a_change_of_a_template_gone_saves_nothing(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path / "templates", tmp_path / "memory")
    store.load()
    assert store.update("missing", lambda t: t) is None
    assert store.list_all() == []
