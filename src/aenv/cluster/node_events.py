"""A cluster's node events, for operators: a node drained or undrained (`aenv node drain`),
failed (its lease lapsed without its release: a crash, a cut-off, a pause too long) or back (it
took its lease anew: a start, or a return after a failure).

One capped Redis stream (`Keys.node_events`, the newest `MAX_EVENTS`). Each event is added by
the script that makes the change it reports (`xadd`), so it is written once however many
gateways and nodes look: a failure by the first look that drops the lapsed node, or by the
node's own return when nobody looked before. It is a log, not state: a Redis wiped loses it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis

from aenv.cluster.store import Keys, guarded

MAX_EVENTS = 10_000


class NodeEventType(enum.StrEnum):
    DRAINED = "node.drained"
    UNDRAINED = "node.undrained"
    FAILED = "node.failed"
    BACK = "node.back"


def xadd(stream: str, kind: NodeEventType | str, node: str, at: str) -> str:
    """The Lua that adds an event; each argument a Lua expression (`kind` a type's name)."""
    typed = f"'{kind.value}'" if isinstance(kind, NodeEventType) else kind
    return (
        f"redis.call('XADD', {stream}, 'MAXLEN', '~', {MAX_EVENTS}, '*',"
        f" 'type', {typed}, 'node', {node}, 'at', {at})"
    )


@dataclass(frozen=True)
class NodeEvent:
    id: str  # the stream entry's id
    type: NodeEventType
    node_id: str
    at: float

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type.value, "nodeID": self.node_id, "at": self.at}


def _event(entry_id: str, fields: dict[str, str]) -> NodeEvent:
    return NodeEvent(entry_id, NodeEventType(fields["type"]), fields["node"], float(fields["at"]))


class NodeEvents:
    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()

    async def list(self, limit: int, node_id: str | None = None) -> list[NodeEvent]:
        """The newest `limit` events (of one node), newest first."""
        async with guarded(self.client, "reading node events"):
            entries = cast(
                "list[tuple[str | bytes, dict[str | bytes, str | bytes]]]",
                await self.client.xrevrange(
                    self.keys.node_events, count=limit if node_id is None else MAX_EVENTS
                ),
            )
        events = [_event(_text(i), {_text(k): _text(v) for k, v in f.items()}) for i, f in entries]
        return [e for e in events if node_id in (None, e.node_id)][:limit]


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
