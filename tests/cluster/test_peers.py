"""Peers before S3: a node restores a manifest from the chunk cache of a node that holds it (its
holders in a real redis-server), over the real internal gate and chunk route, before a real S3
server (moto) on loopback; every chunk is checked, and a peer that dies, hangs or sends a
damaged chunk hands over to the store, as a store that fails hands over to the peer.

The peer is `chunk_peer.py`: a process serving its chunk cache as a node does (the route and
gate of `aenv node`, without VMs), so the test can kill it, stop it, or damage its cache. The
restoring node is a repository in the test process, with the cluster's peer directory."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from moto.server import ThreadedMotoServer
from starlette.applications import Starlette

from aenv.api.app import JSON_ERRORS
from aenv.api.chunks import ChunkRoutes
from aenv.cluster.internal import TOKEN_HEADER, InternalGate
from aenv.cluster.peers import ClusterPeers
from aenv.cluster.registry import Capacity, NodeRegistry, NodeReport
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.store import members
from aenv.orchestrator.archive import Archive
from aenv.storage.repository import (
    ChunkCache,
    Manifest,
    Repository,
    S3Store,
    UnreachableChunk,
)
from aenv.storage.repository.chunks import chunk_key
from aenv.storage.repository.sources import MISSES_IN_A_ROW
from tests.storage.test_repository import assert_same_tree, s3_store
from tests.support.ports import free_port
from tests.support.redis_server import RedisServer
from tests.support.wait import eventually

MiB = 1 << 20
SECRET = ClusterSecret("peers-test-secret-" + "x" * 16)
ROOT = Path(__file__).resolve().parents[2]
MEMORY_CHUNKS = 24
WORKERS = 4


@pytest.fixture
def s3() -> Iterator[ThreadedMotoServer]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def endpoint(server: ThreadedMotoServer) -> str:
    host, port = server.get_host_and_port()
    return f"http://{host}:{port}"


@pytest.fixture
def store(s3: ThreadedMotoServer) -> S3Store:
    return s3_store(endpoint(s3))


@pytest.fixture
async def registry(client: aioredis.Redis) -> NodeRegistry:
    return NodeRegistry(client, SECRET)


def tree(root: Path) -> Path:
    """A checkpoint-like tree: memory of random (incompressible) pages, a disk with holes."""
    root.mkdir(parents=True)
    (root / "memory").write_bytes(os.urandom(MEMORY_CHUNKS * MiB))
    with (root / "disk.img").open("wb") as disk:
        disk.truncate(8 * MiB)
        disk.seek(3 * MiB)
        disk.write(os.urandom(MiB + 5))
    return root


@contextmanager
def repository(store: S3Store, cache: Path, peers: ClusterPeers | None) -> Iterator[Repository]:
    repo = Repository(store, ChunkCache(cache, 1 << 30), workers=WORKERS)
    repo.use_peers(peers)
    try:
        yield repo
    finally:
        repo.close()


class Peer:
    """`chunk_peer.py` serving a chunk cache on loopback, registered as a live node."""

    def __init__(self, name: str, cache: Path) -> None:
        self.name = name
        self.port = free_port()
        self.log = cache.parent / f"{name}.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.cluster.chunk_peer", str(cache), str(self.port),
                 SECRET.value],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip

    def asked(self) -> int:
        """Chunk requests the peer answered (its access log), the test's own probe included."""
        return self.log.read_text().count('"GET /internal/cluster/chunks/')

    @property
    def chunks_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/internal/cluster/chunks/"

    def end(self) -> None:
        self.process.send_signal(signal.SIGCONT)  # a stopped process must run to die
        self.process.kill()
        self.process.wait()


@asynccontextmanager
async def peer(name: str, cache: Path, registry: NodeRegistry) -> AsyncIterator[Peer]:
    served = Peer(name, cache)
    try:
        # An absent chunk is a 404 once the server runs.
        await eventually(lambda: _answers(served), "the peer answers", interval=0.05)
        report = NodeReport(name, f"127.0.0.1:{served.port}", Capacity(2, 1024, 1024, 0, 0))
        await registry.heartbeat(secrets.token_hex(8), report, ttl=120)
        yield served
    finally:
        served.end()


async def _answers(served: Peer) -> bool:
    try:
        async with httpx.AsyncClient() as http:
            answer = await http.get(
                served.chunks_url + "0" * 64, headers={TOKEN_HEADER: SECRET.bearer}
            )
    except httpx.HTTPError:
        return False
    return answer.status_code == 404


async def stored_by_a(store: S3Store, tmp_path: Path, registry: NodeRegistry) -> Manifest:
    """Node A stores a tree: its cache then holds every chunk, and Redis names it a holder."""
    with repository(store, tmp_path / "cache-a", ClusterPeers(registry, "node-a", SECRET)) as a:
        return await a.put_tree(tree(tmp_path / "src"), name="checkpoint")


def chunk_count(manifest: Manifest) -> int:
    return sum(d is not None for f in manifest.files for d in f.chunks)


async def test_a_restore_reads_a_peers_chunks_before_the_store(
    store: S3Store, tmp_path: Path, registry: NodeRegistry, client: aioredis.Redis
) -> None:
    manifest = await stored_by_a(store, tmp_path, registry)
    async with peer("node-a", tmp_path / "cache-a", registry):
        peers = ClusterPeers(registry, "node-b", SECRET)
        with repository(store, tmp_path / "cache-b", peers) as b:
            await b.get_tree(manifest.id, tmp_path / "restored")
            stats, reads = b.stats, Archive(b, tmp_path).reads()
    assert_same_tree(tmp_path / "src", tmp_path / "restored")
    count = chunk_count(manifest)
    assert (stats.chunks_from_peers, stats.chunks_fetched, stats.peer_failures) == (count, 0, 0)
    assert reads["peer"] == (count, stats.bytes_from_peers) and reads["store"] == (0, 0)
    assert stats.bytes_from_peers > MEMORY_CHUNKS * MiB  # random pages: stored uncompressed
    # B holds them now too, for the next node to ask.
    holders = await members(client, registry.keys.chunk_holders(manifest.id))
    assert holders == {"node-a", "node-b"}


async def test_the_store_failing_mid_restore_is_covered_by_the_peer(
    s3: ThreadedMotoServer, store: S3Store, tmp_path: Path, registry: NodeRegistry
) -> None:
    manifest = await stored_by_a(store, tmp_path, registry)
    async with peer("node-a", tmp_path / "cache-a", registry) as served:
        b_peers = ClusterPeers(registry, "node-b", SECRET)
        c_peers = ClusterPeers(registry, "node-c", SECRET)
        with (
            repository(store, tmp_path / "cache-b", b_peers) as b,
            repository(store, tmp_path / "cache-c", c_peers) as c,
        ):
            for node in (b, c):  # their restores have begun: the manifest is read
                await node.manifest(manifest.id)
            s3.stop()
            await b.get_tree(manifest.id, tmp_path / "restored")
            assert b.stats.chunks_from_peers == chunk_count(manifest)
            assert_same_tree(tmp_path / "src", tmp_path / "restored")
            # With A gone too, no source is left for C (B is no holder: its `holding` found
            # Redis, but C asks A only, B having registered no lease): the restore fails
            # whole, saying why.
            served.end()
            with pytest.raises(UnreachableChunk, match="no peer gave it and the store failed"):
                await c.get_tree(manifest.id, tmp_path / "restored-c")
    assert [p.name for p in tmp_path.iterdir() if "restored-c" in p.name] == []


async def test_a_peer_killed_mid_restore_hands_over_to_the_store(
    store: S3Store, tmp_path: Path, registry: NodeRegistry
) -> None:
    manifest = await stored_by_a(store, tmp_path, registry)
    async with peer("node-a", tmp_path / "cache-a", registry) as served:
        peers = ClusterPeers(registry, "node-b", SECRET)
        with repository(store, tmp_path / "cache-b", peers) as b:
            cache = b.cache
            assert cache is not None
            restore = asyncio.create_task(b.get_tree(manifest.id, tmp_path / "restored"))
            # The first chunk from the peer is in B's cache: kill the peer there.
            await eventually(lambda: cache.stats.entries >= 1, "a chunk came", interval=0.001)
            served.process.kill()
            await restore
            stats = b.stats
    assert_same_tree(tmp_path / "src", tmp_path / "restored")
    assert stats.chunks_from_peers >= 1 and stats.chunks_fetched >= 1
    assert stats.chunks_from_peers + stats.chunks_fetched == chunk_count(manifest)
    assert stats.peer_failures == 1  # left out once, not asked again per chunk


async def test_a_hung_peer_is_left_out_after_one_timeout(
    store: S3Store, tmp_path: Path, registry: NodeRegistry
) -> None:
    manifest = await stored_by_a(store, tmp_path, registry)
    async with peer("node-a", tmp_path / "cache-a", registry) as served:
        served.process.send_signal(signal.SIGSTOP)
        peers = ClusterPeers(registry, "node-b", SECRET)
        with repository(store, tmp_path / "cache-b", peers) as b:
            await b.get_tree(manifest.id, tmp_path / "restored")
            stats = b.stats
    assert_same_tree(tmp_path / "src", tmp_path / "restored")
    assert (stats.chunks_from_peers, stats.chunks_fetched) == (0, chunk_count(manifest))
    assert stats.peer_failures == 1


async def test_a_damaged_chunk_from_a_peer_is_refused_and_the_store_kept(
    store: S3Store, tmp_path: Path, registry: NodeRegistry
) -> None:
    manifest = await stored_by_a(store, tmp_path, registry)
    memory = manifest.files[[f.path for f in manifest.files].index("memory")]
    first, second = memory.chunks[0], memory.chunks[1]
    assert first is not None and second is not None
    cache = tmp_path / "cache-a"
    # The peer's cached copy of the first chunk holds the second's bytes.
    (cache / first[:2] / first).write_bytes((cache / second[:2] / second).read_bytes())
    async with peer("node-a", cache, registry):
        peers = ClusterPeers(registry, "node-b", SECRET)
        with repository(store, tmp_path / "cache-b", peers) as b:
            await b.get_tree(manifest.id, tmp_path / "restored")
            stats = b.stats
    assert_same_tree(tmp_path / "src", tmp_path / "restored")
    assert stats.peer_failures == 1 and stats.chunks_fetched >= 1
    assert store.exists(chunk_key(first))  # a peer's damage is not the store's


async def test_a_holder_that_lost_the_chunks_is_left_out_after_a_few(
    store: S3Store, tmp_path: Path, registry: NodeRegistry
) -> None:
    manifest = await stored_by_a(store, tmp_path, registry)
    # A's cache evicted everything since it recorded itself a holder.
    shutil.rmtree(tmp_path / "cache-a")
    async with peer("node-a", tmp_path / "cache-a", registry) as served:
        probes = served.asked()
        peers = ClusterPeers(registry, "node-b", SECRET)
        with repository(store, tmp_path / "cache-b", peers) as b:
            await b.get_tree(manifest.id, tmp_path / "restored")
            stats = b.stats
        asked = served.asked() - probes
    assert_same_tree(tmp_path / "src", tmp_path / "restored")
    assert (stats.chunks_fetched, stats.peer_failures) == (chunk_count(manifest), 0)
    # Left out after MISSES_IN_A_ROW misses, give or take the other workers' asks in flight.
    assert MISSES_IN_A_ROW <= asked <= MISSES_IN_A_ROW + WORKERS - 1


async def test_without_redis_a_restore_reads_the_store(
    store: S3Store, tmp_path: Path, registry: NodeRegistry, redis: RedisServer
) -> None:
    manifest = await stored_by_a(store, tmp_path, registry)
    redis.stop()
    peers = ClusterPeers(registry, "node-b", SECRET)
    with repository(store, tmp_path / "cache-b", peers) as b:
        await b.get_tree(manifest.id, tmp_path / "restored")
        stats = b.stats
    assert_same_tree(tmp_path / "src", tmp_path / "restored")
    assert (stats.chunks_from_peers, stats.chunks_fetched) == (0, chunk_count(manifest))


@asynccontextmanager
async def node_app(repo: Repository | None, serving: int = 8) -> AsyncIterator[httpx.AsyncClient]:
    """A node's chunk route behind its internal gate, in process."""
    routes = ChunkRoutes(repo, serving).routes()
    app = InternalGate(Starlette(routes=routes, exception_handlers=JSON_ERRORS), SECRET)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as http:
        yield http


async def test_the_chunk_route_answers_the_cluster_only(store: S3Store, tmp_path: Path) -> None:
    with repository(store, tmp_path / "cache", None) as repo:
        manifest = await repo.put_tree(tree(tmp_path / "src"), name="x")
        digest = next(d for d in manifest.files[0].chunks if d is not None)
        token = {TOKEN_HEADER: SECRET.bearer}
        path = f"/internal/cluster/chunks/{digest}"
        async with node_app(repo) as http:
            answer = await http.get(path, headers=token)
            assert answer.status_code == 200
            assert answer.headers["content-type"] == "application/zstd"
            assert answer.content == (tmp_path / "cache" / digest[:2] / digest).read_bytes()
            assert (await http.get(path)).status_code == 401
            wrong = {TOKEN_HEADER: "0" * 64}
            assert (await http.get(path, headers=wrong)).status_code == 401
            # Outside the internal prefix (a user's call) the route does not exist.
            assert (await http.get(f"/cluster/chunks/{digest}")).status_code == 404
            absent = await http.get(f"/internal/cluster/chunks/{'0' * 64}", headers=token)
            assert absent.status_code == 404 and "not in this node's cache" in absent.text
            upper = await http.get(f"/internal/cluster/chunks/{digest.upper()}", headers=token)
            assert upper.status_code == 400 and "not a chunk digest" in upper.json()["message"]
        async with node_app(repo, serving=0) as busy:
            answer = await busy.get(path, headers=token)
            assert answer.status_code == 503 and "ask another source" in answer.json()["message"]
        async with node_app(None) as bare:  # a node without a repository holds no chunk
            assert (await bare.get(path, headers=token)).status_code == 404
