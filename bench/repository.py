"""Snapshot repository benchmarks: store and restore a realistic snapshot on POSIX and S3.

The snapshot: a 256 MiB sparse guest memory file holding 90 MiB of random data in 1 MiB runs at
page-aligned (not chunk-aligned) offsets, a 2 MiB device-state file (half random, half zeros)
and `snapshot.json`. Measured, min / median / max over runs:
- put (upload) and get (restore) throughput on a POSIX store and on S3 (moto's server in its own
  process on loopback), as logical MiB/s (file sizes, holes included; `data_median`: the
  91 MiB that are not holes), against the baseline `cp -r --sparse=always` of the same tree on
  the same filesystem (ratio);
- an incremental put after the guest changed 1 MiB: bytes written against the full put (target
  <= 5%);
- restores from S3 through an empty node cache (cold) and again with it filled (warm).

Prints one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aenv.storage.repository import (  # noqa: E402
    BlobStore,
    ChunkCache,
    Manifest,
    PosixStore,
    Repository,
    S3Store,
)
from tests.support.ports import free_port  # noqa: E402

T = TypeVar("T")
MiB = 1 << 20
MEMORY_MIB = 256
DATA_MIB = 90


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_snapshot(root: Path, seed: int) -> int:
    """Writes the snapshot tree; returns its logical size in bytes."""
    rnd = random.Random(seed)
    root.mkdir(parents=True)
    slot = MEMORY_MIB * MiB // (DATA_MIB + 10)  # one 1 MiB run per slot, somewhere inside it
    with (root / "memory").open("wb") as fh:
        fh.truncate(MEMORY_MIB * MiB)
        for i in rnd.sample(range(DATA_MIB + 10), DATA_MIB):
            fh.seek(i * slot + rnd.randrange((slot - MiB) // 4096) * 4096)
            fh.write(rnd.randbytes(MiB))
    (root / "state").write_bytes(rnd.randbytes(MiB) + bytes(MiB))
    (root / "snapshot.json").write_text(json.dumps({"vcpus": 1, "memory_mib": MEMORY_MIB}))
    return sum(p.stat().st_size for p in root.iterdir())


def dirty_one_mib(root: Path, seed: int) -> None:
    """What a guest does between two pauses, at its smallest: rewrite 1 MiB of its memory."""
    rnd = random.Random(seed)
    with (root / "memory").open("r+b") as fh:
        fh.seek(100 * MiB + 12 * 4096)
        fh.write(rnd.randbytes(MiB))


async def timed(operation: Awaitable[T]) -> tuple[float, T]:
    """Seconds `operation` (a coroutine not started yet) takes, and its result."""
    start = time.perf_counter()
    result = await operation
    return time.perf_counter() - start, result


def mib_s(size: int, seconds: list[float]) -> dict[str, float]:
    rates = sorted(size / MiB / s for s in seconds)
    return {
        "min": round(rates[0], 1),
        "median": round(statistics.median(rates), 1),
        "max": round(rates[-1], 1),
    }


@contextmanager
def moto_server() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def s3_store(endpoint: str, bucket: str) -> S3Store:
    store = S3Store(
        bucket,
        endpoint_url=endpoint,
        region="us-east-1",
        access_key_id="bench",
        secret_access_key="bench",
    )
    store._client.create_bucket(Bucket=bucket)  # the bench owns this throwaway bucket
    return store


async def put_get(store: BlobStore, src: Path, dest: Path) -> tuple[float, float, Manifest, int]:
    repo = Repository(store)
    try:
        put, manifest = await timed(repo.put_tree(src, name="bench"))
        get, _ = await timed(repo.get_tree(manifest.id, dest))
        return put, get, manifest, repo.stats.bytes_uploaded
    finally:
        repo.close()


def cp_tree(src: Path, dest: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["cp", "-r", "--sparse=always", str(src), str(dest)], check=True)
    return time.perf_counter() - start


async def bench(work: Path, runs: int) -> dict[str, object]:
    src = work / "src"
    size = make_snapshot(src, seed=1)
    result: dict[str, object] = {
        "benchmark": "repository",
        "date": time.strftime("%Y-%m-%d"),
        "runs": runs,
        "snapshot": {"logical_mib": round(size / MiB, 1), "data_mib": DATA_MIB + 1},
    }

    cp = [cp_tree(src, work / f"cp{n}") for n in range(runs)]
    log(f"cp: {cp}")

    posix_put: list[float] = []
    posix_get: list[float] = []
    for n in range(runs):
        put, get, manifest, stored = await put_get(
            PosixStore(work / f"posix{n}"), src, work / f"posix-restore{n}"
        )
        posix_put.append(put)
        posix_get.append(get)
        log(f"posix {n}: put {put:.2f}s get {get:.2f}s stored {stored / MiB:.1f} MiB")
    result["stored_mib"] = round(stored / MiB, 1)
    result["chunks_stored"] = len(manifest.digests())

    s3_put: list[float] = []
    s3_get: list[float] = []
    cold: list[float] = []
    warm: list[float] = []
    with moto_server() as endpoint:
        for n in range(runs):
            store = s3_store(endpoint, f"bench-{n}")
            put, get, manifest, _ = await put_get(store, src, work / f"s3-restore{n}")
            s3_put.append(put)
            s3_get.append(get)
            log(f"s3 {n}: put {put:.2f}s get {get:.2f}s")

            # Another node: restore through its empty cache, then again through the full one.
            cache = ChunkCache(work / f"cache{n}", max_bytes=1 << 30)
            repo = Repository(store, cache)
            try:
                took, _ = await timed(repo.get_tree(manifest.id, work / f"cold{n}"))
                cold.append(took)
                cold_fetched = repo.stats.bytes_fetched
                cold_hits = cache.stats.hits
                took, _ = await timed(repo.get_tree(manifest.id, work / f"warm{n}"))
                warm.append(took)
                warm_fetched = repo.stats.bytes_fetched - cold_fetched
                warm_hits = cache.stats.hits - cold_hits
            finally:
                repo.close()
            log(f"s3 {n}: cold {cold[-1]:.2f}s warm {warm[-1]:.2f}s")

    base = statistics.median(cp)
    data = (DATA_MIB + 1) * MiB
    result["baseline_cp_mib_s"] = {**mib_s(size, cp), "data_median": mib_s(data, cp)["median"]}
    for name, puts, gets in (("posix", posix_put, posix_get), ("s3_moto", s3_put, s3_get)):
        result[name] = {
            "put_mib_s": {**mib_s(size, puts), "data_median": mib_s(data, puts)["median"]},
            "get_mib_s": {**mib_s(size, gets), "data_median": mib_s(data, gets)["median"]},
            "put_vs_cp": round(base / statistics.median(puts), 2),
            "get_vs_cp": round(base / statistics.median(gets), 2),
        }
    result["restore_s3_cache"] = {
        "cold_s": round(statistics.median(cold), 3),
        "warm_s": round(statistics.median(warm), 3),
        "warm_over_cold": round(statistics.median(warm) / statistics.median(cold), 2),
        "cold_fetched_mib": round(cold_fetched / MiB, 1),
        "warm_fetched_mib": round(warm_fetched / MiB, 1),
        "cold_cache_hits": cold_hits,
        "warm_cache_hits": warm_hits,
        "chunks": len(manifest.digests()),
    }

    # Incremental: the same tree after 1 MiB changed, into the POSIX store holding the full one.
    repo = Repository(PosixStore(work / "posix0"))
    try:
        dirty_one_mib(src, seed=2)
        took, _ = await timed(repo.put_tree(src, name="incremental"))
        written = repo.stats.bytes_uploaded
        result["incremental_1mib_change"] = {
            "full_written_mib": round(stored / MiB, 2),
            "incremental_written_mib": round(written / MiB, 2),
            "chunks_written": repo.stats.chunks_uploaded,
            "ratio_to_full": round(written / stored, 4),
            "put_s": round(took, 3),
        }
    finally:
        repo.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="aenv-bench-repository-") as work:
        result = asyncio.run(bench(Path(work), args.runs))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
