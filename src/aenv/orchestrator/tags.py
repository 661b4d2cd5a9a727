"""Template tags (`name:tag`): which build of a template a tag names, kept in one JSON file.

A template keeps only its newest build, so every tag resolves to the template's current state;
tags are stored and listed as E2B's tag routes have them, for clients that manage them.

In a cluster, a template's record travels with its tags (`with_tags`): published for other
nodes (`aenv.cluster.saved`) and adopted by them (`api.handoff`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
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

    def builds(self, template_id: str) -> dict[str, str]:
        """The template's tags: tag -> build id."""
        return {t.tag: t.build_id for t in self.of(template_id)}

    def take(self, template_id: str, builds: Mapping[str, str]) -> None:
        """Adds the tags another node gave the template (tag -> build id), keeping ours."""
        known = self.builds(template_id)
        for tag, build_id in builds.items():
            if tag not in known:
                self._tags[(template_id, tag)] = Tag(template_id, tag, build_id, time.time())
        self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(self.path, json.dumps([asdict(t) for t in self._tags.values()], indent=2))


def with_tags(record: str, builds: Mapping[str, str]) -> str:
    """A template record (`templates.template_to_json`) with its tags (tag -> build id) under
    `tags`, as nodes of a cluster pass it on."""
    return json.dumps({**json.loads(record), "tags": dict(builds)}) if builds else record


def without_tags(text: str) -> tuple[str, dict[str, str]]:
    """The template record and the tags of `with_tags`'s text (a plain record has none).
    Raises ValueError for what is not JSON."""
    raw = json.loads(text)
    if not isinstance(raw, dict) or "tags" not in raw:
        return text, {}
    tags = raw.pop("tags")
    if not isinstance(tags, dict):
        raise ValueError("tags are an object of tag -> build id")
    return json.dumps(raw), {str(k): str(v) for k, v in tags.items()}
