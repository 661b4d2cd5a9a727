"""Whole-file replacement, also with two writers of one file at once."""

from __future__ import annotations

import threading
from pathlib import Path

from aenv import atomic


def test_concurrent_writers_of_one_file_never_fail(tmp_path: Path) -> None:
    path = tmp_path / "template.json"
    errors: list[BaseException] = []

    def writer(text: str) -> None:
        try:
            for _ in range(300):
                atomic.write_text(path, text)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t * 1000,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert path.read_text() in ("a" * 1000, "b" * 1000)
    assert [p.name for p in tmp_path.iterdir()] == ["template.json"]  # no temporaries left
    assert path.stat().st_mode & 0o777 == 0o600
