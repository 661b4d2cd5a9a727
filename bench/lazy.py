"""State that travels lazily (issue 34): pulls from a peer before S3, a disk image read on demand,
and a paused sandbox resumed on another node.

Two nodes on this machine and one S3 server (moto's, in its own process) on loopback. Node A
stores a checkpoint-like tree (`bench/repository.py`'s: a 256 MiB sparse memory file holding
90 MiB of random data, 2 MiB of device state) plus a 64 MiB disk image with 24 MiB of data, so
its chunk cache holds all of it, and serves that cache as a node does (`tests/cluster/
chunk_peer.py`: the internal gate and chunk route), registered in a real redis-server as the
holder. Node B, with an empty cache each run, pulls the tree:

- `pull_s3`: from S3 only (no peers: today's pull);
- `pull_peer`: peers before S3 (all from A);
- `pull_cache`: again, through B's now full cache;
- `lazy_first_read`: the disk image as a `LazyFile` served as a FUSE file (as restores serve
  read-only drives), and `qemu-io` reading 4 KiB of it: the time and the bytes moved before
  that read answers, against the whole pull.

Ratios are against `pull_s3` in the same run; bytes by source (cache, peer, store) for each.

`resume`: two real nodes (real VMs) sharing the S3 repository behind a gateway
(`bench/cluster.py`'s cluster), the SDK in the gateway's namespace: one sandbox (16 MiB of fresh
data written) resumed on the node it paused on against the same resumed on the other node
after its own is drained (its files served lazily there), alternating, `--runs` samples of
each: the time to `Sandbox.connect` + `commands.run("true")`, the target node's pull reads by
source (compressed bytes) between just before and just after that answer (an upper bound of
what the answer needed: the background fetch runs meanwhile), the same over the whole move (until
paused again there: everything the node read to hold the checkpoint, by source: `cache` its own
chunk cache, `peer` the other node, `store` S3), and the sandbox's directory there once paused
again (its checkpoint, whole). Then the same on a second cluster whose nodes pull
whole (`lazy_pulls = false`, as before issue 34), in the same run; with `--against no-prefetch`,
on a cluster whose nodes serve lazily but fetch nothing ahead of reads (`lazy_prefetch = 0`).

`create`: the same two-node cluster; each sample makes a new snapshot on node A (a sandbox
from `base` with 16 MiB of fresh data, `create_snapshot`, killed), then times a create from it
(`Sandbox.create` + `commands.run("true")`) on A, where its files are (B drained), against the
first create from it on B, which has never seen it (A drained: B serves the snapshot's files
lazily), and a second create on B (its files held by then); B's pull reads by source between
just before and just after its first create answered. Then the same on a cluster whose nodes
pull whole (`lazy_pulls = false`).

`disk`: the same cluster; a running sandbox reads the larger files of its root disk (the
first 600 files over 32 KiB under /usr, its page cache dropped first) on the node it was made
on, `--runs` times, then is paused, resumed on the other node (its own drained: served
lazily) and, once that node's pull reads stop growing (the background fetch ended), reads them
`--runs` times there: the throughput, served warm over local.

`fork`: the same cluster; a running sandbox (16 MiB of fresh data) forked into 16 children, `--runs`
times, its children killed each time: on two nodes holding 9 sandboxes each at most (8 children
spill to the node that never saw the parent's fork checkpoint, whose files it serves lazily),
against one node (the other drained), each on a cluster of its own.

Prints one JSON document on stdout; progress goes to stderr.

    python bench/lazy.py [pulls|resume|create|disk|fork] [--runs 3] [--against whole|no-prefetch]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from repository import MiB, log, make_snapshot, moto_server, s3_store  # noqa: E402

from aenv.cluster.peers import ClusterPeers  # noqa: E402
from aenv.cluster.registry import Capacity, NodeRegistry, NodeReport  # noqa: E402
from aenv.cluster.secret import ClusterSecret  # noqa: E402
from aenv.cluster.store import connect  # noqa: E402
from aenv.storage.fusefile import FuseFile  # noqa: E402
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
        fuse = FuseFile(lazy, "root.img")
        (work / "mnt").mkdir()
        await asyncio.to_thread(fuse.mount, work / "mnt", asyncio.get_running_loop())
        try:
            process = await asyncio.create_subprocess_exec(
                "qemu-io", "-r", "-f", "raw", "-c", "read 8M 4k", str(fuse.path),
                stdout=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            await process.wait()
            took = time.perf_counter() - start
        finally:
            await asyncio.to_thread(fuse.unmount)
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


# Runs in the gateway's namespace: `make` (a sandbox with fresh data, paused: its id), `resume
# ID NODE_URL` (connect and run a command: the seconds, and NODE_URL's pull reads by source,
# compressed bytes, just before and just after, and the reads before), `reads NODE_URL` (its pull
# reads by source so far), `pause ID`.
RESUME_CLIENT = """
import json, re, sys, time
import httpx
from e2b import Sandbox
command, *args = sys.argv[1:]

def reads(url):
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.findall(r'aenv_repository_read_bytes_total[{]source="(\\w+)"[}] ([0-9.e+]+)', text)
    return {source: float(value) for source, value in found}

if command == "make":
    sandbox = Sandbox.create("base", timeout=3600)
    sandbox.commands.run("head -c 16777216 /dev/urandom > /home/user/data")
    sandbox.pause()
    print(json.dumps(sandbox.sandbox_id))
elif command == "resume":
    before = reads(args[1])
    start = time.perf_counter()
    Sandbox.connect(args[0], timeout=3600).commands.run("true")
    took = time.perf_counter() - start
    after = reads(args[1])
    print(json.dumps([took, {k: after.get(k, 0) - before.get(k, 0) for k in after}, before]))
elif command == "reads":
    print(json.dumps(reads(args[0])))
else:
    print(json.dumps(Sandbox.pause(args[0])))
"""


# What `resume` sets the lazy cluster against: nodes that pull whole (as before issue 34), or
# nodes that serve lazily with nothing fetched ahead of reads (`lazy_prefetch = 0`).
AGAINST = {
    "whole": ("whole_pulls", {"AENV_LAZY_PULLS": "false"}),
    "no-prefetch": ("lazy_no_prefetch", {"AENV_LAZY_PREFETCH": "0"}),
}


async def resume(work: Path, samples: int, against: str = "whole") -> dict[str, object]:
    """`resume_on` with lazy pulls, then on a cluster set as `AGAINST[against]`."""
    name, settings = AGAINST[against]
    (work / "lazy").mkdir()
    (work / "other").mkdir()
    lazy = await resume_on(work / "lazy", samples, {})
    other = await resume_on(work / "other", samples, settings)
    lazy_other = statistics.median(lazy.pop("other_node_s_all"))  # type: ignore[arg-type]
    other_other = statistics.median(other.pop("other_node_s_all"))  # type: ignore[arg-type]
    return {
        "benchmark": "lazy resume",
        "date": time.strftime("%Y-%m-%d"),
        "samples": samples,
        "lazy_pulls": lazy,
        name: other,
        f"lazy_over_{name}_other_node_median": round(lazy_other / other_other, 2),
    }


async def resume_on(work: Path, samples: int, settings: dict[str, str]) -> dict[str, object]:
    """A paused sandbox resumed on the node it paused on, against the same resumed on the
    other node (its own drained: the release uploads, the connect moves it), alternating."""
    from cluster import on_cluster, sandbox_bytes

    beat = {"AENV_HEARTBEAT_INTERVAL": "2", **settings}
    async with on_cluster(work, ["node-a", "node-b"], beat, shared_repository=True) as on:

        def client(*args: str) -> Any:
            return on.client(RESUME_CLIENT, *args)

        sandbox_id = client("make")
        node = await on.routes.lookup(sandbox_id)
        assert node is not None
        url = f"http://{on.nodes.addresses[node]}"
        same: list[float] = []
        other: list[float] = []
        before_answer: list[dict[str, float]] = []
        whole_move: list[dict[str, float]] = []  # the move's reads by source, once paused again
        checkpoint: list[int] = []
        for_reads: list[int] = []  # chunks reads needed (lazy pulls), from the node's log
        waited: list[int] = []  # of which reads found missing and waited for
        for n in range(samples):
            took, _, _ = client("resume", sandbox_id, url)
            same.append(took)
            client("pause", sandbox_id)
            on.aenv("node", "drain", node)
            target = next(i for i in on.nodes.addresses if i != node)
            target_url = f"http://{on.nodes.addresses[target]}"
            took, moved, reads_before = client("resume", sandbox_id, target_url)
            other.append(took)
            before_answer.append(moved)
            assert await on.routes.lookup(sandbox_id) == target
            on.aenv("node", "undrain", node)
            client("pause", sandbox_id)  # waits until its files are local
            checkpoint.append(sandbox_bytes(work / target, sandbox_id))
            reads_after = client("reads", target_url)
            whole_move.append({k: v - reads_before.get(k, 0) for k, v in reads_after.items()})
            log_text = (work / target / "server.log").read_text()
            needed = re.findall(r"reads needed (\d+) chunks of its checkpoint and waited for (\d+)",
                                log_text)  # fmt: skip
            if needed:
                for_reads.append(int(needed[-1][0]))
                waited.append(int(needed[-1][1]))
            log(f"sample {n}: same {same[-1]:.2f}s, other {other[-1]:.2f}s, moved {moved}")
            node, url = target, f"http://{on.nodes.addresses[target]}"
    same_med, other_med = statistics.median(same), statistics.median(other)
    moved_total = [sum(m.values()) for m in before_answer]
    return {
        "other_node_s_all": other,
        "resume_same_node_s": [round(t, 2) for t in same],
        "resume_other_node_s": [round(t, 2) for t in other],
        "other_over_same_median": round(other_med / same_med, 2),
        "moved_before_first_answer_mib": [
            {k: round(v / MiB, 1) for k, v in m.items()} for m in before_answer
        ],
        "moved_by_source_whole_move_mib": [
            {k: round(v / MiB, 1) for k, v in m.items()} for m in whole_move
        ],
        "sandbox_dir_after_pause_mib": [round(c / MiB, 1) for c in checkpoint],
        "chunks_reads_needed": for_reads,
        "chunks_reads_waited_for": waited,
        "moved_over_checkpoint": [
            round(m / c, 3) for m, c in zip(moved_total, checkpoint, strict=True)
        ],
    }


# Runs in the gateway's namespace: `snap NAME` (a sandbox with fresh data snapshotted as NAME,
# then killed), `create REF NODE_URL` (a sandbox from REF answering a command: the seconds, and
# NODE_URL's pull reads by source just before and after; then killed).
CREATE_CLIENT = """
import json, re, sys, time
import httpx
from e2b import Sandbox
command, *args = sys.argv[1:]

def reads(url):
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.findall(r'aenv_repository_read_bytes_total[{]source="(\\w+)"[}] ([0-9.e+]+)', text)
    return {source: float(value) for source, value in found}

if command == "snap":
    sandbox = Sandbox.create("base", timeout=600)
    sandbox.commands.run("head -c 16777216 /dev/urandom > /home/user/data")
    sandbox.create_snapshot(name=args[0])
    sandbox.kill()
    print(json.dumps(args[0]))
else:
    before = reads(args[1])
    start = time.perf_counter()
    sandbox = Sandbox.create(args[0], timeout=600)
    sandbox.commands.run("true")
    took = time.perf_counter() - start
    after = reads(args[1])
    sandbox.kill()
    print(json.dumps([took, {k: after.get(k, 0) - before.get(k, 0) for k in after}]))
"""


async def create(work: Path, samples: int) -> dict[str, object]:
    """`create_on` with lazy pulls, then on a cluster whose nodes pull whole (before)."""
    (work / "lazy").mkdir()
    (work / "whole").mkdir()
    lazy = await create_on(work / "lazy", samples, {})
    whole = await create_on(work / "whole", samples, {"AENV_LAZY_PULLS": "false"})
    lazy_unseen = statistics.median(lazy.pop("unseen_s_all"))  # type: ignore[arg-type]
    whole_unseen = statistics.median(whole.pop("unseen_s_all"))  # type: ignore[arg-type]
    return {
        "benchmark": "lazy create",
        "date": time.strftime("%Y-%m-%d"),
        "samples": samples,
        "lazy_pulls": lazy,
        "whole_pulls": whole,
        "lazy_over_whole_unseen_median": round(lazy_unseen / whole_unseen, 2),
    }


async def create_on(work: Path, samples: int, settings: dict[str, str]) -> dict[str, object]:
    """Creates from a new snapshot on its own node against on a node that never saw it."""
    from cluster import on_cluster

    from aenv.cluster.saved import SavedRecords

    beat = {"AENV_HEARTBEAT_INTERVAL": "2", **settings}
    async with on_cluster(work, ["node-a", "node-b"], beat, shared_repository=True) as on:

        def client(*args: str) -> Any:
            return on.client(CREATE_CLIENT, *args)

        saved = SavedRecords(on.routes.client)
        url = {n: f"http://{a}" for n, a in on.nodes.addresses.items()}
        local: list[float] = []
        unseen: list[float] = []
        again: list[float] = []
        moved: list[dict[str, float]] = []
        for n in range(samples):
            name = f"bench-{n}-{secrets.token_hex(3)}"
            on.aenv("node", "drain", "node-b")
            client("snap", name)
            while await saved.find(name) is None:  # published once in the repository
                await asyncio.sleep(0.5)
            took, _ = client("create", name, url["node-a"])
            local.append(took)
            on.aenv("node", "undrain", "node-b")
            on.aenv("node", "drain", "node-a")
            took, reads = client("create", name, url["node-b"])
            unseen.append(took)
            moved.append(reads)
            took, _ = client("create", name, url["node-b"])
            again.append(took)
            on.aenv("node", "undrain", "node-a")
            log(f"sample {n}: local {local[-1]:.2f}s, unseen {unseen[-1]:.2f}s, "
                f"again {again[-1]:.2f}s, moved {reads}")  # fmt: skip
    return {
        "unseen_s_all": unseen,
        "create_on_its_node_s": [round(t, 2) for t in local],
        "create_on_a_node_that_never_saw_it_s": [round(t, 2) for t in unseen],
        "second_create_there_s": [round(t, 2) for t in again],
        "unseen_over_local_median": round(statistics.median(unseen) / statistics.median(local), 2),
        "moved_before_first_answer_mib": [
            {k: round(v / MiB, 1) for k, v in m.items()} for m in moved
        ],
    }


# Runs in the gateway's namespace: `make` (a running sandbox: its id), `read ID` (the guest's
# page cache dropped, then the files of its root disk read: the seconds and the bytes), `pause
# ID`, `resume ID`, `reads NODE_URL` (its pull reads so far, compressed bytes).
DISK_CLIENT = """
import json, re, sys, time
import httpx
from e2b import Sandbox
command, *args = sys.argv[1:]
READ = ("sudo sh -c 'sync; echo 3 > /proc/sys/vm/drop_caches' && "
        "find /usr -xdev -type f -size +32k -print0 | sort -z | head -z -n 600 "
        "| xargs -0 cat | wc -c")
if command == "make":
    print(json.dumps(Sandbox.create("base", timeout=3600).sandbox_id))
elif command == "read":
    sandbox = Sandbox.connect(args[0], timeout=3600)
    start = time.perf_counter()
    out = sandbox.commands.run(READ, timeout=1800).stdout
    print(json.dumps([time.perf_counter() - start, int(out.split()[-1])]))
elif command == "pause":
    print(json.dumps(Sandbox.pause(args[0])))
elif command == "resume":
    Sandbox.connect(args[0], timeout=3600).commands.run("true")
    print(json.dumps(True))
else:
    text = httpx.get(args[0] + "/metrics", timeout=30).text
    found = re.findall(r'aenv_repository_read_bytes_total[{]source="(\\w+)"[}] ([0-9.e+]+)', text)
    print(json.dumps(sum(float(value) for _, value in found)))
"""


async def disk(work: Path, samples: int) -> dict[str, object]:
    """A guest reading its root disk's files (page cache dropped) on the node it was made on,
    against the same once resumed on the other node, served lazily, after the background fetch
    has ended (the node's pull reads stopped growing): `samples` reads each."""
    from cluster import on_cluster

    beat = {"AENV_HEARTBEAT_INTERVAL": "2"}
    async with on_cluster(work, ["node-a", "node-b"], beat, shared_repository=True) as on:

        def client(*args: str) -> Any:
            return on.client(DISK_CLIENT, *args)

        sandbox_id = client("make")
        node = await on.routes.lookup(sandbox_id)
        assert node is not None
        target = next(i for i in on.nodes.addresses if i != node)
        local = [client("read", sandbox_id) for _ in range(samples)]
        client("pause", sandbox_id)
        on.aenv("node", "drain", node)
        client("resume", sandbox_id)
        assert await on.routes.lookup(sandbox_id) == target
        url = f"http://{on.nodes.addresses[target]}"
        last = -1.0
        while (now := client("reads", url)) != last:  # until the background fetch ended
            last = now
            await asyncio.sleep(5)
        served = [client("read", sandbox_id) for _ in range(samples)]
    rate = [b / t / MiB for t, b in local]
    lazy_rate = [b / t / MiB for t, b in served]
    log(f"local {rate} MiB/s, lazily served, warm {lazy_rate} MiB/s")
    return {
        "benchmark": "lazy disk",
        "date": time.strftime("%Y-%m-%d"),
        "bytes_read_mib": round(local[0][1] / MiB, 1),
        "local_mib_s": [round(r, 1) for r in rate],
        "served_warm_mib_s": [round(r, 1) for r in lazy_rate],
        "served_over_local_median": round(
            statistics.median(lazy_rate) / statistics.median(rate), 2
        ),
    }


# Runs in the gateway's namespace: `make` (a running sandbox: its id), `fork ID COUNT` (the
# seconds until every child started, their ids, the errors), `kill ID...`.
FORK_CLIENT = """
import json, sys, time
from e2b import Sandbox
command, *args = sys.argv[1:]
if command == "make":
    sandbox = Sandbox.create("base", timeout=3600)
    sandbox.commands.run("head -c 16777216 /dev/urandom > /home/user/data")
    print(json.dumps(sandbox.sandbox_id))
elif command == "fork":
    start = time.perf_counter()
    children = Sandbox.fork(args[0], count=int(args[1]), timeout=600)
    took = time.perf_counter() - start
    ids = [c.sandbox_id for c in children if isinstance(c, Sandbox)]
    print(json.dumps([took, ids, [repr(c) for c in children if not isinstance(c, Sandbox)]]))
else:
    for sandbox_id in args:
        Sandbox.kill(sandbox_id)
    print(json.dumps(True))
"""
FORKS = 16


async def fork(work: Path, samples: int) -> dict[str, object]:
    """`fork_on` two nodes (each holding 9 sandboxes at most, so 8 children spill to the other,
    which never saw the parent's fork checkpoint) against one (the other drained)."""
    (work / "two").mkdir()
    (work / "one").mkdir()
    two = await fork_on(work / "two", samples, {"AENV_MAX_SANDBOXES": "9"}, spread=True)
    one = await fork_on(work / "one", samples, {}, spread=False)
    two_med = statistics.median(two["fork_s"])  # type: ignore[arg-type]
    one_med = statistics.median(one["fork_s"])  # type: ignore[arg-type]
    return {
        "benchmark": "lazy fork",
        "date": time.strftime("%Y-%m-%d"),
        "children": FORKS,
        "two_nodes": two,
        "one_node": one,
        "two_over_one_median": round(two_med / one_med, 2),
    }


async def fork_on(
    work: Path, samples: int, settings: dict[str, str], spread: bool
) -> dict[str, object]:
    from cluster import on_cluster

    beat = {"AENV_HEARTBEAT_INTERVAL": "2", **settings}
    async with on_cluster(work, ["node-a", "node-b"], beat, shared_repository=True) as on:

        def client(*args: str) -> Any:
            return on.client(FORK_CLIENT, *args)

        parent = client("make")
        node = await on.routes.lookup(parent)
        assert node is not None
        if not spread:
            on.aenv("node", "drain", next(i for i in on.nodes.addresses if i != node))
        took: list[float] = []
        placed: list[dict[str, int]] = []
        failed: list[list[str]] = []
        for n in range(samples):
            seconds, children, errors = client("fork", parent, str(FORKS))
            took.append(seconds)
            failed.append(errors)
            where: dict[str, int] = {}
            for child in children:
                at = await on.routes.lookup(child)
                where[str(at)] = where.get(str(at), 0) + 1
            placed.append(where)
            client("kill", *children)
            log(f"sample {n}: fork x{FORKS} {seconds:.2f}s, {where}, {len(errors)} failed")
    return {
        "fork_s": took,
        "children_by_node": placed,
        "failed": failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "mode", nargs="?", choices=["pulls", "resume", "create", "disk", "fork"], default="pulls"
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--against", choices=sorted(AGAINST), default="whole",
                        help="resume: the second cluster's nodes")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="aenv-bench-lazy-") as work:
        if args.mode == "resume":
            result = asyncio.run(resume(Path(work), args.runs, args.against))
        elif args.mode == "create":
            result = asyncio.run(create(Path(work), args.runs))
        elif args.mode == "disk":
            result = asyncio.run(disk(Path(work), args.runs))
        elif args.mode == "fork":
            result = asyncio.run(fork(Path(work), args.runs))
        else:
            result = asyncio.run(bench(Path(work), args.runs))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
