"""Webhooks and their deliveries, in the catalog: E2B's `/events/webhooks` registrations, and
one `webhook_deliveries` row per event and webhook that is both the durable queue and the log.

A delivery is `pending` from the event's transaction (`enqueue`) until it is `delivered`,
`failed` (its attempts ran out or its target was refused) or `dropped` (its webhook's queue
held `queue_limit` newer ones: a dead receiver costs a bounded table, the oldest go first).
Deliveries of one webhook are sent in the order of their events, one at a time
(`webhook_delivery`), so each sandbox's events arrive in order. Finished rows are the log an
operator reads; the retention removes them with their events (`forget_before`).
"""

from __future__ import annotations

import builtins
import enum
import json
import sqlite3
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from aenv.orchestrator.catalog import Catalog


class DeliveryState(enum.StrEnum):
    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"
    DROPPED = "dropped"


@dataclass(frozen=True)
class Webhook:
    id: str
    team_id: str
    name: str
    url: str
    enabled: bool
    events: tuple[str, ...]
    # What deliveries are signed with; never answered by the API.
    secret: str
    created_at: float


@dataclass(frozen=True)
class Delivery:
    """One event for one webhook. `body` is the event's JSON, as it is sent."""

    id: str
    webhook_id: str
    event_seq: int
    state: DeliveryState
    attempts: int
    last_status: int | None
    last_error: str | None
    created_at: float
    updated_at: float
    event_id: str
    body: str


def new_webhook(
    team_id: str, name: str, url: str, enabled: bool, events: Sequence[str], secret: str
) -> Webhook:
    """A webhook registered now, with an id of its own."""
    return Webhook(
        str(uuid.uuid4()), team_id, name, url, enabled, tuple(events), secret, time.time()
    )


def _write(db: sqlite3.Connection, hook: Webhook) -> None:
    """Insert `hook`, or replace the webhook of its id (its queue and log stay)."""
    db.execute(
        "INSERT OR REPLACE INTO webhooks (id, team_id, name, url, enabled, events, secret,"
        " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (
            hook.id,
            hook.team_id,
            hook.name,
            hook.url,
            int(hook.enabled),
            json.dumps(list(hook.events)),
            hook.secret,
            hook.created_at,
        ),
    )


def _webhook(row: sqlite3.Row) -> Webhook:
    return Webhook(
        id=row["id"],
        team_id=row["team_id"],
        name=row["name"],
        url=row["url"],
        enabled=bool(row["enabled"]),
        events=tuple(json.loads(row["events"])),
        secret=row["secret"],
        created_at=row["created_at"],
    )


def _delivery(row: sqlite3.Row) -> Delivery:
    return Delivery(
        id=row["id"],
        webhook_id=row["webhook_id"],
        event_seq=row["event_seq"],
        state=DeliveryState(row["state"]),
        attempts=row["attempts"],
        last_status=row["last_status"],
        last_error=row["last_error"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        event_id=row["event_id"],
        body=row["body"],
    )


_DELIVERIES = (
    "SELECT d.*, e.id AS event_id, e.body FROM webhook_deliveries d"
    " JOIN events e ON e.seq = d.event_seq"
)


def enqueue(
    db: sqlite3.Connection, team_id: str, event_type: str, event_seq: int, now: float, limit: int
) -> int:
    """Queue event `event_seq` for each enabled webhook of the team that asked for its type
    (inside the event's transaction); the count queued. A queue past `limit` drops its oldest."""
    hooks = db.execute(
        "SELECT id FROM webhooks WHERE team_id = ? AND enabled = 1 AND EXISTS"
        " (SELECT 1 FROM json_each(webhooks.events) WHERE value = ?)",
        (team_id, event_type),
    ).fetchall()
    for (webhook_id,) in hooks:
        db.execute(
            "INSERT INTO webhook_deliveries (id, webhook_id, event_seq, state, created_at,"
            " updated_at) VALUES (?, ?, ?, ?, ?, ?)",
            (str(uuid.uuid4()), webhook_id, event_seq, DeliveryState.PENDING.value, now, now),
        )
        db.execute(
            "UPDATE webhook_deliveries SET state = ?, updated_at = ?, last_error = ?"
            " WHERE webhook_id = ? AND state = ? AND event_seq <= (SELECT event_seq FROM"
            " webhook_deliveries WHERE webhook_id = ? AND state = ?"
            " ORDER BY event_seq DESC LIMIT 1 OFFSET ?)",
            (
                DeliveryState.DROPPED.value,
                now,
                f"the webhook's queue held {limit} newer deliveries",
                webhook_id,
                DeliveryState.PENDING.value,
                webhook_id,
                DeliveryState.PENDING.value,
                limit,
            ),
        )
    return len(hooks)


def forget_before(db: sqlite3.Connection, cutoff: float) -> None:
    """Remove the deliveries of events written before `cutoff`, and finished ones older."""
    db.execute(
        "DELETE FROM webhook_deliveries WHERE event_seq IN"
        " (SELECT seq FROM events WHERE created_at < ?) OR (state != ? AND updated_at < ?)",
        (cutoff, DeliveryState.PENDING.value, cutoff),
    )


class WebhookStore:
    """The `webhooks` and `webhook_deliveries` tables; every read is scoped to a team."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    @property
    def _db(self) -> sqlite3.Connection:
        return self.catalog.db

    def create(
        self, team_id: str, name: str, url: str, enabled: bool, events: Sequence[str], secret: str
    ) -> Webhook:
        hook = new_webhook(team_id, name, url, enabled, events, secret)
        _write(self._db, hook)
        return hook

    def list(self, team_id: str) -> list[Webhook]:
        rows = self._db.execute(
            "SELECT * FROM webhooks WHERE team_id = ? ORDER BY created_at, id", (team_id,)
        )
        return [_webhook(row) for row in rows]

    def get(self, team_id: str, webhook_id: str) -> Webhook | None:
        row = self._db.execute(
            "SELECT * FROM webhooks WHERE team_id = ? AND id = ?", (team_id, webhook_id)
        ).fetchone()
        return _webhook(row) if row else None

    def by_id(self, webhook_id: str) -> Webhook | None:
        """Any team's webhook (the dispatcher's read)."""
        row = self._db.execute("SELECT * FROM webhooks WHERE id = ?", (webhook_id,)).fetchone()
        return _webhook(row) if row else None

    def update(self, team_id: str, webhook_id: str, **changes: Any) -> Webhook | None:
        """Change `name`, `url`, `enabled`, `events` or `secret`; None when it is not the
        team's."""
        columns: dict[str, Any] = {}
        for name, value in changes.items():
            if name not in ("name", "url", "enabled", "events", "secret"):
                raise ValueError(f"not a changeable field: {name}")
            columns[name] = (
                json.dumps(list(value))
                if name == "events"
                else int(value)
                if name == "enabled"
                else value
            )
        if columns:
            sets = ", ".join(f"{name} = ?" for name in columns)
            self._db.execute(
                f"UPDATE webhooks SET {sets} WHERE team_id = ? AND id = ?",  # noqa: S608
                (*columns.values(), team_id, webhook_id),
            )
        return self.get(team_id, webhook_id)

    def delete(self, team_id: str, webhook_id: str) -> bool:
        """Remove a webhook and its queue and log."""
        with self.catalog.transaction() as db:
            cursor = db.execute(
                "DELETE FROM webhooks WHERE team_id = ? AND id = ?", (team_id, webhook_id)
            )
            if cursor.rowcount != 1:
                return False
            db.execute("DELETE FROM webhook_deliveries WHERE webhook_id = ?", (webhook_id,))
        return True

    def mirror(self, hooks: Sequence[Webhook]) -> None:
        """Make the webhooks exactly `hooks` (a cluster's, `aenv.cluster.webhooks`): those
        not among them go with their queues and logs; the others are written as given, their
        queues and logs kept."""
        wanted = {hook.id for hook in hooks}
        with self.catalog.transaction() as db:
            for (webhook_id,) in db.execute("SELECT id FROM webhooks").fetchall():
                if webhook_id not in wanted:
                    db.execute("DELETE FROM webhooks WHERE id = ?", (webhook_id,))
                    db.execute("DELETE FROM webhook_deliveries WHERE webhook_id = ?", (webhook_id,))
            for hook in hooks:
                _write(db, hook)

    # -- the queue ------------------------------------------------------------------------

    def with_pending(self) -> set[str]:
        """The webhooks (enabled) with deliveries to make."""
        rows = self._db.execute(
            "SELECT DISTINCT d.webhook_id FROM webhook_deliveries d JOIN webhooks w"
            " ON w.id = d.webhook_id WHERE d.state = ? AND w.enabled = 1",
            (DeliveryState.PENDING.value,),
        )
        return {row[0] for row in rows}

    def next(self, webhook_id: str) -> Delivery | None:
        """The webhook's oldest pending delivery."""
        row = self._db.execute(
            f"{_DELIVERIES} WHERE d.webhook_id = ? AND d.state = ? ORDER BY d.event_seq LIMIT 1",
            (webhook_id, DeliveryState.PENDING.value),
        ).fetchone()
        return _delivery(row) if row else None

    def attempted(
        self,
        delivery_id: str,
        state: DeliveryState,
        attempts: int,
        status: int | None,
        error: str | None,
    ) -> None:
        """Record an attempt's outcome (`state` pending: it is tried again)."""
        self._db.execute(
            "UPDATE webhook_deliveries SET state = ?, attempts = ?, last_status = ?,"
            " last_error = ?, updated_at = ? WHERE id = ?",
            (state.value, attempts, status, error, time.time(), delivery_id),
        )

    def counts(self) -> dict[DeliveryState, int]:
        """The deliveries of the log (every team's) by state."""
        rows = self._db.execute("SELECT state, COUNT(*) FROM webhook_deliveries GROUP BY state")
        found = {DeliveryState(state): count for state, count in rows}
        return {state: found.get(state, 0) for state in DeliveryState}

    def log(
        self,
        team_id: str,
        webhook_id: str,
        limit: int,
        states: Collection[DeliveryState] = (),
    ) -> builtins.list[Delivery]:
        """A webhook's deliveries, newest first (empty for another team's webhook)."""
        where = ["d.webhook_id = ?", "w.team_id = ?"]
        params: list[Any] = [webhook_id, team_id]
        if states:
            where.append(f"d.state IN ({', '.join('?' for _ in states)})")
            params += [s.value for s in states]
        rows = self._db.execute(
            f"{_DELIVERIES} JOIN webhooks w ON w.id = d.webhook_id"
            f" WHERE {' AND '.join(where)} ORDER BY d.event_seq DESC LIMIT ?",
            [*params, limit],
        )
        return [_delivery(row) for row in rows]
