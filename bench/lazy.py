"""State that travels lazily (issue 34), the parts built so far: pulls from a peer before S3, and
a disk image read on demand.

Two nodes on this machine and one S3 server (moto's, in its own process) on loopback. Node A
stores a checkpoint-like tree (`bench/repository.py`'s: a 256 MiB sparse memory file holding
90 MiB of random data, 2 MiB of device state) plus a 64 MiB disk image with 24 MiB of data, so
its chunk cache holds all of it, and serves that cache as a node does (`tests/cluster/
chunk_peer.py`: the internal gate and chunk route), registered in a real redis-server as the
holder. Node B, with an empty cache each run, pulls the tree:

- `pull_s3`: from S3 only (no peers: today's pull);
- `pull_peer`: peers before S3 (all from A);
- `pull_cache`: again, through B's now full cache;
- `lazy_first_read`: the disk image as a `LazyFile` served over NBD, and `qemu-io` reading
  4 KiB of it: the time and the bytes moved before that read answers, against the whole pull.

Ratios are against `pull_s3` in the same run; bytes by source (cache, peer, store) for each.
Prints one JSON document on stdout; progress goes to stderr.

    python bench/lazy.py [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from repository import MiB, log, make_snapshot, moto_server, s3_store  # noqa: E402

from aenv.cluster.peers import ClusterPeers  # noqa: E402
from aenv.cluster.registry import Capacity, NodeRegistry, NodeReport  # noqa: E402
from aenv.cluster.secret import ClusterSecret  # noqa: E402
from aenv.cluster.store import connect  # noqa: E402
from aenv.storage.nbd import NbdExport  # noqa: E402
from aenv.storage.repository import ChunkCache, Repository, S3Store  # noqa: E402
from aenv.storage.repository.lazy import LazyFile  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402
from tests.support.wait import eventually_sync  # noqa: E402

SECRET = ClusterSecret(secrets.token_hex(16))
IMAGE_MIB = 64
IMAGE_DATA_MIB = 24


def make_image(path: Path) -> None:
    """A disk image: `IMAGE_DATA_MIB` MiB of random data spread over `IMAGE_MIB`, holes between."""
    with path.open("wb") as fh:
        fh.truncate(IMAGE_MIB * MiB)
        for i in range(IMAGE_DATA_MIB):
            fh.seek(i * (IMAGE_MIB // IMAGE_DATA_MIB) * MiB)
            fh.write(secrets.token_bytes(MiB))


@contextmanager
def peer_process(cache: Path) -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.cluster.chunk_peer", str(cache), str(port), SECRET.value],
        cwd=REPO,
    )
    try:
        eventually_sync(lambda: _listening(port), "the peer listens")
        yield port
    finally:
        proc.kill()
        proc.wait()


def _listening(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def node(store: S3Store, cache: Path, peers: ClusterPeers | None) -> Repository:
    repo = Repository(store, ChunkCache(cache, 4 << 30))
    repo.use_peers(peers)
    return repo


def by_source(repo: Repository) -> dict[str, float]:
    stats = repo.stats
    return {
        "cache_mib": round(stats.bytes_from_cache / MiB, 1),
        "peer_mib": round(stats.bytes_from_peers / MiB, 1),
        "store_mib": round(stats.bytes_fetched / MiB, 1),
    }


async def first_read(
    store: S3Store, cache: Path, peers: ClusterPeers, manifest_id: str, work: Path
) -> tuple[float, dict[str, float]]:
    """Seconds until qemu-io's 4 KiB read of the lazily served image answers, and the bytes
    moved by then."""
    repo = node(store, cache, peers)
    try:
        start = time.perf_counter()
        manifest = await repo.manifest(manifest_id)
        entry = next(f for f in manifest.files if f.path == "root.img")
        lazy = LazyFile(repo, manifest, entry, work / "lazy.img")
        server = await NbdExport(lazy).serve(work / "nbd.sock")
        try:
            process = await asyncio.create_subprocess_exec(
                "qemu-io", "-r", "-f", "raw", "-c", "read 8M 4k",
                f"nbd+unix:///?socket={work / 'nbd.sock'}",
                stdout=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            await process.wait()
            took = time.perf_counter() - start
        finally:
            server.close()
            await server.wait_closed()
            lazy.close()
        return took, by_source(repo)
    finally:
        repo.close()


async def bench(work: Path, runs: int) -> dict[str, object]:
    src = work / "src"
    size = make_snapshot(src, seed=1)
    make_image(src / "root.img")
    size += IMAGE_MIB * MiB
    result: dict[str, object] = {"benchmark": "lazy", "date": time.strftime("%Y-%m-%d"),
                                 "runs": runs}  # fmt: skip
    times: dict[str, list[float]] = {"pull_s3": [], "pull_peer": [], "pull_cache": [],
                                     "lazy_first_read": []}  # fmt: skip
    sources: dict[str, dict[str, float]] = {}
    redis = RedisServer(work / "redis")
    (work / "redis").mkdir()
    redis.start()
    client = connect(redis.url)
    try:
        registry = NodeRegistry(client, SECRET)
        with moto_server() as endpoint:
            store = s3_store(endpoint, "bench-lazy")
            a = node(store, work / "cache-a", ClusterPeers(registry, "node-a", SECRET))
            try:
                manifest = await a.put_tree(src, name="checkpoint")
                stored = a.stats.bytes_uploaded  # a new bucket: every chunk, compressed
            finally:
                a.close()
            result["checkpoint"] = {"logical_mib": round(size / MiB, 1),
                                    "stored_mib": round(stored / MiB, 1)}  # fmt: skip
            with peer_process(work / "cache-a") as port:
                report = NodeReport("node-a", f"127.0.0.1:{port}", Capacity(2, 1, 1, 0, 0))
                await registry.heartbeat(secrets.token_hex(8), report, ttl=3600)
                for n in range(runs):
                    await one_run(store, registry, manifest.id, work / f"run{n}", times, sources)
                    log(f"run {n}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()))
    finally:
        await client.aclose()
        redis.stop()
    base = statistics.median(times["pull_s3"])
    for name, taken in times.items():
        median = statistics.median(taken)
        result[name] = {"median_s": round(median, 3), "min_s": round(min(taken), 3),
                        "max_s": round(max(taken), 3), "vs_pull_s3": round(median / base, 3),
                        "read_by_source": sources[name]}  # fmt: skip
    moved = sum(sources["lazy_first_read"].values()) * MiB
    result["lazy_moved_share_of_checkpoint"] = round(moved / stored, 4)
    return result


async def one_run(
    store: S3Store,
    registry: NodeRegistry,
    manifest_id: str,
    work: Path,
    times: dict[str, list[float]],
    sources: dict[str, dict[str, float]],
) -> None:
    work.mkdir()
    b = node(store, work / "cache-s3", None)
    try:
        start = time.perf_counter()
        await b.get_tree(manifest_id, work / "from-s3")
        times["pull_s3"].append(time.perf_counter() - start)
        sources["pull_s3"] = by_source(b)
    finally:
        b.close()
    b = node(store, work / "cache-peer", ClusterPeers(registry, "node-b", SECRET))
    try:
        start = time.perf_counter()
        await b.get_tree(manifest_id, work / "from-peer")
        times["pull_peer"].append(time.perf_counter() - start)
        sources["pull_peer"] = by_source(b)
        before = b.stats
        start = time.perf_counter()
        await b.get_tree(manifest_id, work / "from-cache")
        times["pull_cache"].append(time.perf_counter() - start)
        after = b.stats
        sources["pull_cache"] = {
            "cache_mib": round((after.bytes_from_cache - before.bytes_from_cache) / MiB, 1),
            "peer_mib": round((after.bytes_from_peers - before.bytes_from_peers) / MiB, 1),
            "store_mib": round((after.bytes_fetched - before.bytes_fetched) / MiB, 1),
        }
    finally:
        b.close()
    # B's entry as a holder would name a node that serves nothing here: only A serves.
    await registry.client.delete(registry.keys.chunk_holders(manifest_id))
    await ClusterPeers(registry, "node-a", SECRET).holding(manifest_id)
    took, moved = await first_read(
        store, work / "cache-lazy", ClusterPeers(registry, "node-c", SECRET), manifest_id, work
    )
    times["lazy_first_read"].append(took)
    sources["lazy_first_read"] = moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="aenv-bench-lazy-") as work:
        result = asyncio.run(bench(Path(work), args.runs))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
