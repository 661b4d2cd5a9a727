"""Volume throughput (issue 15): sequential write and read of one file inside a real guest, on a
mounted volume (virtio-9p, `envd/mounts.py`) against the guest's own disk (virtio-blk under
the overlay root), in the same sandbox and the same run. A real `aenv server` in its own
network namespace, driven by the unmodified `e2b` SDK (see server_ns.py).

Each run writes AENV_BENCH_VOLUME_MIB (64) MiB with `dd ... conv=fsync` (the write counts only
once it is on the host), drops the guest's page cache, then reads the file back with `dd`. The
guest's clock times both. The baseline is the guest's disk: ratios are the volume's median
throughput over the disk's (target >= 0.5). AENV_BENCH_RUNS runs (5). Prints one JSON
document on stdout; progress goes to stderr.

Then what a volume costs the sandbox's life, in the same run: `Sandbox.create` with one volume
against one without (the baseline; alternated, AENV_BENCH_RUNS each), and for each a pause then
a connect at once (a save with memory needs the guest to unmount its volumes first).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

from server_ns import bench_server, client_env, describe, entry, log, report, run_client

RUNS = int(os.environ.get("AENV_BENCH_RUNS", "5"))
MIB = int(os.environ.get("AENV_BENCH_VOLUME_MIB", "64"))
TARGET_RATIO = 0.5
VOLUME_DIR = "/mnt/bench"
DISK_DIR = "/home/user"
# Nanoseconds of the write (with fsync) and of the read, printed by the guest.
SCRIPT = """f={dir}/bench.bin
s=$(date +%s%N); dd if=/dev/zero of=$f bs=1M count={mib} conv=fsync 2>/dev/null; e=$(date +%s%N)
sync; echo 3 > /proc/sys/vm/drop_caches
r=$(date +%s%N); dd if=$f of=/dev/null bs=1M 2>/dev/null; d=$(date +%s%N)
rm -f $f
echo $((e - s)) $((d - r))"""


def measure(sandbox: Any, directory: str) -> tuple[float, float]:
    """MiB/s of the write and of the read in `directory`."""
    out = sandbox.commands.run(SCRIPT.format(dir=directory, mib=MIB), user="root").stdout
    write_ns, read_ns = (int(x) for x in out.split())
    return MIB / (write_ns / 1e9), MIB / (read_ns / 1e9)


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "n": len(samples),
        "min": round(min(samples), 1),
        "median": round(statistics.median(samples), 1),
        "max": round(max(samples), 1),
    }


def client() -> None:
    """Runs inside the server's namespace."""
    from importlib.metadata import version

    from e2b import Sandbox, Volume

    client_env()
    volume = Volume.create("bench")
    sandbox = Sandbox.create(timeout=1800, volume_mounts={VOLUME_DIR: volume})
    try:
        samples: dict[str, list[float]] = {k: [] for k in ("disk_write", "disk_read")}
        samples |= {"volume_write": [], "volume_read": []}
        log(f"{RUNS} runs of {MIB} MiB...")
        for i in range(RUNS):
            # Alternated, so a slower phase of the host does not favour one side.
            for name, directory in (("disk", DISK_DIR), ("volume", VOLUME_DIR)):
                write, read = measure(sandbox, directory)
                samples[f"{name}_write"].append(write)
                samples[f"{name}_read"].append(read)
            log(f"run {i + 1}: {json.dumps({k: round(v[-1], 1) for k, v in samples.items()})}")
    finally:
        sandbox.kill()
    try:
        creates = create_times(volume)
    finally:
        Volume.destroy(volume.volume_id)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    result: dict[str, Any] = {
        "sdk": f"e2b {version('e2b')}",
        "runs": RUNS,
        "file_mib": MIB,
        "mib_per_s": {k: summary(v) for k, v in samples.items()},
        "ratio_write": round(medians["volume_write"] / medians["disk_write"], 3),
        "ratio_read": round(medians["volume_read"] / medians["disk_read"], 3),
        "target_ratio": TARGET_RATIO,
        "create_ms": {k: summary(v) for k, v in creates.items()},
        "ratio_volume_over_plain": {
            step: round(
                statistics.median(creates[f"{step}_with_volume"])
                / statistics.median(creates[f"{step}_plain"]),
                2,
            )
            for step in ("create", "pause_then_connect")
        },
    }
    print(json.dumps(result))


def create_times(volume: Any) -> dict[str, list[float]]:
    """Milliseconds of creates without and with `volume` mounted, and of a connect right after
    a pause of each (the one with the volume has its guest release it for the save)."""
    from e2b import Sandbox

    times: dict[str, list[float]] = {}
    for i in range(RUNS):
        for name, mounts in (("plain", {}), ("with_volume", {VOLUME_DIR: volume})):
            start = time.perf_counter()
            sandbox = Sandbox.create(timeout=600, volume_mounts=mounts)
            times.setdefault(f"create_{name}", []).append((time.perf_counter() - start) * 1000)
            sandbox.pause()
            start = time.perf_counter()
            sandbox = Sandbox.connect(sandbox.sandbox_id, timeout=600)
            elapsed = (time.perf_counter() - start) * 1000
            times.setdefault(f"pause_then_connect_{name}", []).append(elapsed)
            sandbox.kill()
        log(f"create run {i + 1}: {json.dumps({k: round(v[-1]) for k, v in times.items()})}")
    return times


def main() -> None:
    with bench_server() as server:
        result = run_client(server, [sys.executable, __file__, "--client"], timeout=3600)
        machine = describe(server)
    report("volumes", **machine, **result)


if __name__ == "__main__":
    entry(main, client)
