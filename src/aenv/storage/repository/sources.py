"""Where a restore's chunks come from besides the store: the peers that hold them, asked first.

A node restoring a manifest reads each chunk from its own cache, else from the peers known to
hold the manifest's chunks (other nodes' caches: a cluster node's `PeerDirectory` names them,
`aenv.cluster.peers`), one after the other, else from the store. A peer is asked over HTTP: a
GET of its location's URL followed by the digest, answered with the chunk as stored (one zstd
frame), 404 when it lacks it. Every answer is decoded and checked against the chunk's digest
whatever its source, so a peer can waste time but never supply wrong bytes.

A restore asks its peers through one `PeerSession`, which leaves a peer out for the rest of the
restore once it fails (no answer in time, an error status, a damaged chunk, too busy: 503), so a
dead or hung peer costs each worker at most one timeout and the store takes over; a peer that
lacks `MISSES_IN_A_ROW` chunks in a row (its cache evicted them) is left out too, so a stale
entry of the directory costs a few round trips, not one per chunk.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

from aenv.storage.repository.chunks import CHUNK_SIZE, DecodeError, decode

MISSES_IN_A_ROW = 4
# A peer on the same network answers a cached chunk in milliseconds; one that has not within
# these bounds is left out for the rest of the restore, and the next source takes over.
CONNECT_TIMEOUT = 1.0
READ_TIMEOUT = 3.0
# zstd's bound on one chunk's frame is a little above the chunk; anything longer is no chunk.
MAX_ANSWER = CHUNK_SIZE + (CHUNK_SIZE >> 7) + 4096


class Source(enum.StrEnum):
    """Where a chunk a restore needed came from."""

    CACHE = "cache"  # this node's chunk cache
    PEER = "peer"  # another node's chunk cache
    STORE = "store"  # the repository's store (S3, a directory)


class PeerUnavailable(Exception):
    """A peer gave no answer to use (down, too slow, an error, busy); nothing was read."""


class PeerLocation(Protocol):
    """One other node that may hold chunks: a chunk is a GET of `url` + its digest."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Sent with every request (the peer's credentials)."""
        ...


class PeerDirectory(Protocol):
    """Which nodes hold which manifest's chunks. Its methods never raise: a directory that
    cannot answer (its Redis down) names no peers, and the store serves every chunk."""

    async def peers(self, manifest_id: str) -> Sequence[PeerLocation]:
        """Other nodes believed to hold the manifest's chunks, in the order to ask them."""
        ...

    async def holding(self, manifest_id: str) -> None:
        """This node now holds the manifest's chunks (it stored or restored them)."""
        ...

    async def dropped(self, manifest_id: str) -> None:
        """The manifest was deleted: nobody is to ask for it any more."""
        ...


def http_client() -> httpx.Client:
    """The client a repository asks its peers with (blocking: its threads ask them)."""
    return httpx.Client(
        timeout=httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT),
        limits=httpx.Limits(max_connections=32, max_keepalive_connections=16),
    )


def ask(client: httpx.Client, peer: PeerLocation, digest: str) -> bytes | None:
    """The peer's chunk as stored, unverified, or None when it lacks it; raises
    `PeerUnavailable`. Blocking."""
    try:
        with client.stream("GET", peer.url + digest, headers=dict(peer.headers)) as answer:
            if answer.status_code == 404:
                return None
            if answer.status_code != 200:
                raise PeerUnavailable(f"peer {peer.name} answered {answer.status_code}")
            body = bytearray()
            for part in answer.iter_bytes():
                body += part
                if len(body) > MAX_ANSWER:
                    raise PeerUnavailable(f"peer {peer.name} sent more than a chunk")
            return bytes(body)
    except httpx.HTTPError as error:
        raise PeerUnavailable(f"peer {peer.name}: {error!r}") from error


@dataclass(frozen=True)
class PeerChunk:
    data: bytes
    blob: bytes  # as the peer sent it (compressed): checked, since `data` decoded from it
    peer: str


class PeerSession:
    """The peers of one restore (see the module docstring); safe to use from many threads."""

    def __init__(
        self,
        client: httpx.Client | None,
        peers: Sequence[PeerLocation],
        failed: Callable[[], None] = lambda: None,
    ) -> None:
        """`failed` is called (from the failing thread) for each peer left out after a failure."""
        self._client = client
        self._failed = failed
        self._lock = threading.Lock()
        self._live = list(peers) if client is not None else []
        self._misses = dict.fromkeys((p.name for p in self._live), 0)

    def fetch(self, digest: str, length: int) -> PeerChunk | None:
        """The chunk, verified, from the first peer that has it; None when none gave it."""
        client = self._client
        if client is None:
            return None
        for peer in self._candidates():
            try:
                blob = ask(client, peer, digest)
            except PeerUnavailable:
                self._leave_out(peer, failed=True)
                continue
            if blob is None:
                self._missed(peer)
                continue
            try:
                data = decode(blob, digest, length)
            except DecodeError:
                self._leave_out(peer, failed=True)
                continue
            with self._lock:
                self._misses[peer.name] = 0
            return PeerChunk(data, blob, peer.name)
        return None

    def _candidates(self) -> list[PeerLocation]:
        with self._lock:
            return list(self._live)

    def _missed(self, peer: PeerLocation) -> None:
        with self._lock:
            self._misses[peer.name] += 1
            lacking = self._misses[peer.name] >= MISSES_IN_A_ROW
        if lacking:
            self._leave_out(peer, failed=False)

    def _leave_out(self, peer: PeerLocation, *, failed: bool) -> None:
        with self._lock:
            left = peer in self._live
            if left:
                self._live.remove(peer)
        if left and failed:
            self._failed()
