"""envd benchmarks through the official e2b SDK, each against a baseline measured in the same run.

- `commands.run("true")` round trip vs spawning `/bin/bash -l -c true` locally (our overhead);
- `files.write` / `files.read` of a 256 MiB file vs a local `cp` of it (throughput ratio);
- 100 concurrent `commands.run` from asyncio: total time and p99.

envd runs in the same throwaway root the tests use. Prints one JSON document.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from summary import summary_ms

from tests.support.envd_process import envd_in_throwaway_root

# Not envd's usual 49983, so the benchmark can run beside the test suite; the SDK in debug mode
# follows E2B_SANDBOX_URL.
PORT = 49990
RUNS = 200
FILE_MIB = 256
CONCURRENT = 100


def timed(fn: object, runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        samples.append(time.perf_counter() - start)
    return samples


# The baseline runs inside the sandbox's own root, as the same user, so it pays the same shell
# start-up (profile scripts) that a command run through envd pays.
LOCAL_SPAWN = f"""
import json, subprocess, time
samples = []
for _ in range({RUNS}):
    start = time.perf_counter()
    subprocess.run(["/bin/bash", "-l", "-c", "true"], check=True)
    samples.append(time.perf_counter() - start)
print(json.dumps(samples))
"""


def bench_run(sandbox: object) -> dict[str, object]:
    script = sandbox.commands.run(f"python3 -c '{LOCAL_SPAWN}'", timeout=0)  # type: ignore[attr-defined]
    local = json.loads(script.stdout)
    sdk = timed(lambda: sandbox.commands.run("true"), RUNS)  # type: ignore[attr-defined]
    local_p50, sdk_p50 = statistics.median(local), statistics.median(sdk)
    return {
        "local_spawn_ms": summary_ms(local),
        "sdk_run_ms": summary_ms(sdk),
        "overhead_p50_ms": round((sdk_p50 - local_p50) * 1000, 3),
        "ratio_p50": round(sdk_p50 / local_p50, 2),
    }


def bench_files(sandbox: object) -> dict[str, object]:
    scratch = Path(tempfile.mkdtemp(prefix="aenv-bench-"))
    try:
        src = scratch / "src.bin"
        with src.open("wb") as f:
            for _ in range(FILE_MIB):
                f.write(os.urandom(1024 * 1024))
        size = src.stat().st_size
        start = time.perf_counter()
        shutil.copyfile(src, scratch / "copy.bin")
        local_s = time.perf_counter() - start
        with src.open("rb") as f:
            start = time.perf_counter()
            sandbox.files.write("/tmp/bench.bin", f)  # type: ignore[attr-defined]
            write_s = time.perf_counter() - start
        # The SDK streams a file object in 64 KiB reads on the client side; an iterable of
        # bigger chunks shows what envd itself sustains.
        with src.open("rb") as f:
            start = time.perf_counter()
            sandbox.files.write("/tmp/bench.bin", iter(lambda: f.read(4 << 20), b""))  # type: ignore[attr-defined]
            write_big_s = time.perf_counter() - start
        start = time.perf_counter()
        received = 0
        for chunk in sandbox.files.read("/tmp/bench.bin", format="stream"):  # type: ignore[attr-defined]
            received += len(chunk)
        read_s = time.perf_counter() - start
        assert received == size, (received, size)
        sandbox.files.remove("/tmp/bench.bin")  # type: ignore[attr-defined]
    finally:
        shutil.rmtree(scratch)
    mib = size / 2**20
    return {
        "size_mib": round(mib),
        "local_copy_mib_s": round(mib / local_s, 1),
        "write_mib_s": round(mib / write_s, 1),
        "read_mib_s": round(mib / read_s, 1),
        "write_4mib_chunks_mib_s": round(mib / write_big_s, 1),
        "write_ratio_to_copy": round(local_s / write_s, 3),
        "write_4mib_chunks_ratio_to_copy": round(local_s / write_big_s, 3),
        "read_ratio_to_copy": round(local_s / read_s, 3),
    }


async def bench_concurrent() -> dict[str, object]:
    from e2b import AsyncSandbox

    sandbox = await AsyncSandbox.create()

    async def one() -> float:
        start = time.perf_counter()
        await sandbox.commands.run("true")
        return time.perf_counter() - start

    await one()  # warm the connection pool
    start = time.perf_counter()
    latencies = await asyncio.gather(*(one() for _ in range(CONCURRENT)))
    total = time.perf_counter() - start
    return {
        "count": CONCURRENT,
        "total_ms": round(total * 1000, 1),
        "latency_ms": summary_ms(list(latencies)),
    }


def main() -> None:
    os.environ["E2B_DEBUG"] = "true"
    from e2b import Sandbox

    with envd_in_throwaway_root(PORT) as url:
        os.environ["E2B_SANDBOX_URL"] = url
        sandbox = Sandbox.create()
        sandbox.commands.run("true")  # warm up
        result = {
            "benchmark": "envd",
            "date": time.strftime("%Y-%m-%d"),
            "commands_run_true": bench_run(sandbox),
            "files_256mib": bench_files(sandbox),
            "concurrent_runs": asyncio.run(bench_concurrent()),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
