"""The envd bundle's size and its start-up time, against envd from the project venv.

Start-up is the time from launching envd until `GET /health` first answers 204, each run in a
fresh throwaway root (the tests' harness, whose namespace and mount set-up every figure includes):
the bundle mounted read-only at /opt/aenv in a Debian minbase root (no python3) and in a
busybox-only root, and, as the baseline, `python -m aenv.envd` from the venv in the host-root
overlay the envd tests use. Prints one JSON document.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aenv.envd_bundle import PREFIX, build_bundle
from tests.support.envd_process import (
    envd_in_throwaway_root,
    serve_in_throwaway_root,
)
from tests.support.ports import free_port
from tests.support.rootfs import busybox_root, debian_minbase

RUNS = 5
POLL = 0.002  # seconds between /health probes


def startup(serve: Callable[[int], AbstractContextManager[str]]) -> dict[str, float]:
    samples = []
    for _ in range(RUNS):
        port = free_port()
        start = time.perf_counter()
        with serve(port):
            samples.append(time.perf_counter() - start)
    return {
        "min": round(min(samples), 3),
        "median": round(statistics.median(samples), 3),
        "max": round(max(samples), 3),
    }


def bundle_in(root: Path, bundle: Path) -> Callable[[int], AbstractContextManager[str]]:
    def serve(port: int) -> AbstractContextManager[str]:
        envd = [f"{PREFIX}/aenv-envd", "--host", "127.0.0.1", "--port", str(port)]
        options = ["--lower", str(root), "--ro-bind", str(bundle), PREFIX]
        return serve_in_throwaway_root(envd, port, harness_options=options, poll_interval=POLL)

    return serve


def main() -> None:
    bundle = build_bundle().parent
    files = [p for p in bundle.rglob("*") if p.is_file()]
    with tempfile.TemporaryDirectory(prefix="aenv-bench-busybox-") as scratch:
        report = {
            "bundle": {
                "files": len(files),
                "mib": round(sum(p.stat().st_size for p in files) / 2**20, 1),
            },
            "runs": RUNS,
            "startup_to_health_s": {
                "bundle_debian_minbase": startup(bundle_in(debian_minbase(), bundle)),
                "bundle_busybox": startup(bundle_in(busybox_root(Path(scratch)), bundle)),
                "venv_python": startup(
                    lambda port: envd_in_throwaway_root(port, poll_interval=POLL)
                ),
            },
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
