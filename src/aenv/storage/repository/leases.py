"""Leases: how puts and garbage collection, on any number of nodes, keep out of each other's way.

A lease is a small object `leases/<kind>-<token>.json` holding its expiry time; its holder
rewrites it every third of its time to live and deletes it when done. A lease whose expiry has
passed belongs to a process that died and counts for nothing (clocks must agree to well within a
lease's time to live, which NTP gives). Each side writes its own lease *before* looking for the
other's, which makes the two mutually exclusive without any atomic compare-and-swap in the store
(see `garbage.py` for why that suffices).

An operation must not commit what its lease protects once it might have expired:
`Lease.check()` raises `LeaseLost` when the last successful write is too old.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import time
from types import TracebackType
from typing import Literal

from aenv.storage.repository.errors import BlobNotFound, LeaseLost
from aenv.storage.repository.store import BlobStore

PREFIX = "leases/"
Kind = Literal["put", "gc"]
DEFAULT_TTL = 300.0


def _record(kind: Kind, expires: float) -> bytes:
    doc = {"kind": kind, "expires": expires, "host": socket.gethostname(), "pid": os.getpid()}
    return json.dumps(doc).encode()


def _expiry(data: bytes) -> float:
    try:
        return float(json.loads(data)["expires"])
    except (ValueError, KeyError, TypeError):
        return 0.0  # writes are atomic, so this is not a lease we wrote: ignore it


def scan(store: BlobStore, kind: Kind) -> tuple[list[str], list[str]]:
    """Keys of the live and of the expired leases of `kind` (blocking)."""
    live: list[str] = []
    expired: list[str] = []
    now = time.time()
    for info in store.list(f"{PREFIX}{kind}-"):
        try:
            expires = _expiry(store.get(info.key))
        except BlobNotFound:  # released since the listing
            continue
        (live if expires > now else expired).append(info.key)
    return live, expired


async def live(store: BlobStore, kind: Kind) -> bool:
    found, _ = await asyncio.to_thread(scan, store, kind)
    return bool(found)


class Lease:
    """`async with Lease(store, "put"):` holds a lease of that kind for the block."""

    def __init__(self, store: BlobStore, kind: Kind, ttl: float = DEFAULT_TTL) -> None:
        self.store = store
        self.kind = kind
        self.ttl = ttl
        self.key = f"{PREFIX}{kind}-{secrets.token_hex(8)}.json"
        self._valid_until = 0.0
        self._refresher: asyncio.Task[None] | None = None

    async def _write(self) -> None:
        start = time.time()
        await asyncio.to_thread(self.store.put, self.key, _record(self.kind, start + self.ttl))
        self._valid_until = start + self.ttl

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            # A failed write leaves the old expiry in force: check() then fails in time.
            with contextlib.suppress(Exception):
                await self._write()

    def check(self) -> None:
        # A margin of a tenth of the lifetime covers the commit that follows the check.
        if time.time() > self._valid_until - self.ttl / 10:
            raise LeaseLost(f"lease {self.key} may have expired")

    async def __aenter__(self) -> Lease:
        await self._write()
        self._refresher = asyncio.create_task(self._refresh())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        await asyncio.to_thread(self.store.delete, self.key)
