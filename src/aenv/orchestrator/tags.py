"""Template tags (`name:tag`): which build of a template a tag names, kept in one JSON file.

A template keeps only its newest build, so every tag resolves to the template's current state;
tags are stored and listed as E2B's tag routes have them, for clients that manage them.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from aenv import atomic


@dataclass(frozen=True)
class Tag:
    template_id: str
    tag: str
    build_id: str
    created_at: float


class TagStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._tags: dict[tuple[str, str], Tag] = {}
        try:
            for raw in json.loads(path.read_text()):
                tag = Tag(**raw)
                self._tags[(tag.template_id, tag.tag)] = tag
        except (OSError, ValueError, TypeError):
            pass  # none yet, or unreadable: tags are advisory

    def assign(self, template_id: str, tags: list[str], build_id: str) -> None:
        now = time.time()
        for name in tags:
            self._tags[(template_id, name)] = Tag(template_id, name, build_id, now)
        self._save()

    def remove(self, template_id: str, tags: list[str]) -> None:
        for name in tags:
            self._tags.pop((template_id, name), None)
        self._save()

    def of(self, template_id: str) -> list[Tag]:
        found = [t for t in self._tags.values() if t.template_id == template_id]
        return sorted(found, key=lambda t: t.created_at)

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(self.path, json.dumps([asdict(t) for t in self._tags.values()], indent=2))
