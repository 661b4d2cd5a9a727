"""Sandbox lifecycle events: what E2B's events API serves and webhooks deliver.

An event is written to the catalog's `events` table as its sandbox's state change is made, by
the operation that made it (`record`), in E2B's shape: created, updated, paused, resumed,
checkpointed (a snapshot) and killed, each with the sandbox's id, template and build, team,
metadata and time, and on paused and killed its execution's start, vCPUs, memory and run time.
An execution is one run of a sandbox, from its create or resume to its pause or kill: the
created or resumed event names it (`sandboxExecutionId`).

The same transaction queues the event for every enabled webhook of its team that asked for its
type (`webhooks.enqueue`), so a restart loses neither; delivery runs in the background
(`webhook_delivery`) and never delays the operation. Events are kept
`Config.events_retention_days` (`sweep`, run by the housekeeping).
"""

from __future__ import annotations

import enum
import json
import sqlite3
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aenv.orchestrator import webhooks
from aenv.orchestrator.catalog import Catalog, SandboxRecord
from aenv.orchestrator.templates import TemplateStore

# E2B's event structure version (`version`): v2 has the dotted `type`.
VERSION = "v2"


class EventType(enum.StrEnum):
    CREATED = "sandbox.lifecycle.created"
    UPDATED = "sandbox.lifecycle.updated"
    PAUSED = "sandbox.lifecycle.paused"
    RESUMED = "sandbox.lifecycle.resumed"
    CHECKPOINTED = "sandbox.lifecycle.checkpointed"
    KILLED = "sandbox.lifecycle.killed"


class KillReason(enum.StrEnum):
    """Why a sandbox was killed (`kill_reason` of its killed event): E2B's names."""

    REQUEST = "request"  # a client's kill
    TIMEOUT = "timeout"  # its timeout, without autoPause (or the pause failed)
    ADMIN = "admin"  # the node's shutdown, with `pause_on_shutdown` off or the pause failed
    ORPHANED = "orphaned"  # found running by a restart: its VM died with the previous process
    UNKNOWN = "unknown"  # its VMM exited on its own, or its VM vanished


# The events that start an execution.
_STARTS = (EventType.CREATED, EventType.RESUMED)


def timestamp(at: float) -> str:
    """An RFC 3339 UTC time with microseconds (`2025-08-06T20:59:24.123456Z`; E2B's docs
    show whole seconds): events of several nodes are merged by it, and two of one second
    would otherwise tie. Fixed width, so that text order is time order."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class SandboxEvent:
    id: str
    type: EventType
    created_at: float
    sandbox_id: str
    execution_id: str
    template_id: str
    build_id: str
    team_id: str
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """E2B's JSON of the event: the events API's items and a webhook delivery's body."""
        return {
            "version": VERSION,
            "id": self.id,
            "type": self.type.value,
            "eventData": dict(self.data) or None,
            "sandboxBuildId": self.build_id,
            "sandboxExecutionId": self.execution_id,
            "sandboxId": self.sandbox_id,
            "sandboxTeamId": self.team_id,
            "sandboxTemplateId": self.template_id,
            "timestamp": timestamp(self.created_at),
        }


@dataclass(frozen=True)
class EventQuery:
    """One page of a team's events (of one sandbox with `sandbox_id`), by time of writing."""

    team_id: str
    limit: int
    offset: int = 0
    ascending: bool = False
    types: Collection[EventType] = ()
    sandbox_id: str | None = None


class EventLog:
    """The `events` table of the catalog. `recorded` is told after an event's transaction
    queued deliveries (the webhook dispatcher, which then makes them)."""

    def __init__(self, catalog: Catalog, templates: TemplateStore, queue_limit: int) -> None:
        """`queue_limit`: the pending deliveries a webhook holds at most."""
        self.catalog = catalog
        self.templates = templates
        self.queue_limit = queue_limit
        self.recorded: list[Callable[[], None]] = []

    def record(
        self,
        kind: EventType,
        record: SandboxRecord,
        data: Mapping[str, Any] | None = None,
        *,
        ends_execution: bool = False,
    ) -> SandboxEvent | None:
        """Write an event of `record`'s sandbox, as its state is now, with the figures of the
        execution it ends when `ends_execution`. The node's own sandboxes (template builds)
        have none."""
        if record.internal:
            return None
        now = time.time()
        payload: dict[str, Any] = {"sandbox_metadata": dict(record.metadata), **(data or {})}
        with self.catalog.transaction() as db:
            execution_id, started = self._execution(db, record)
            if kind in _STARTS:
                execution_id, started = str(uuid.uuid4()), now
            if ends_execution:
                payload["execution"] = {
                    "started_at": timestamp(started),
                    "vcpu_count": record.cpu_count,
                    "memory_mb": record.memory_mb,
                    "execution_time": round((now - started) * 1000),
                }
            event = SandboxEvent(
                id=str(uuid.uuid4()),
                type=kind,
                created_at=now,
                sandbox_id=record.id,
                execution_id=execution_id,
                template_id=record.template_id,
                build_id=self._build_of(record.template_id),
                team_id=record.team_id,
                data=payload,
            )
            cursor = db.execute(
                "INSERT INTO events (id, type, team_id, sandbox_id, execution_id, created_at,"
                " body) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    event.id,
                    kind.value,
                    event.team_id,
                    record.id,
                    execution_id,
                    now,
                    json.dumps(event.to_json()),
                ),
            )
            assert cursor.lastrowid is not None
            queued = webhooks.enqueue(
                db, event.team_id, kind.value, cursor.lastrowid, now, self.queue_limit
            )
        if queued:
            for listener in self.recorded:
                listener()
        return event

    def _build_of(self, template_id: str) -> str:
        template = self.templates.by_id(template_id)
        return template.build_id if template else ""

    @staticmethod
    def _execution(db: sqlite3.Connection, record: SandboxRecord) -> tuple[str, float]:
        """The current execution of a sandbox: its id and start (its create's or latest
        resume's event; the record's start when that event has gone with the retention)."""
        row = db.execute(
            "SELECT execution_id, created_at FROM events WHERE sandbox_id = ? AND type IN"
            " (?, ?) ORDER BY seq DESC LIMIT 1",
            (record.id, *(t.value for t in _STARTS)),
        ).fetchone()
        return (row[0], row[1]) if row else ("", record.started_at)

    def page(self, query: EventQuery) -> list[dict[str, Any]]:
        """The events' JSON, oldest first with `ascending`, else newest first."""
        where, params = ["team_id = ?"], [query.team_id]
        if query.sandbox_id is not None:
            where.append("sandbox_id = ?")
            params.append(query.sandbox_id)
        if query.types:
            where.append(f"type IN ({', '.join('?' for _ in query.types)})")
            params += [t.value for t in query.types]
        order = "ASC" if query.ascending else "DESC"
        rows = self.catalog.db.execute(
            f"SELECT body FROM events WHERE {' AND '.join(where)} "  # noqa: S608 - ours
            f"ORDER BY seq {order} LIMIT ? OFFSET ?",
            [*params, query.limit, query.offset],
        )
        return [json.loads(row[0]) for row in rows]

    def sweep(self, retention_days: float) -> int:
        """Remove the events older than the retention, and their deliveries; the count."""
        cutoff = time.time() - retention_days * 86400
        with self.catalog.transaction() as db:
            webhooks.forget_before(db, cutoff)
            return db.execute("DELETE FROM events WHERE created_at < ?", (cutoff,)).rowcount
