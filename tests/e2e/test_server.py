"""End-to-end: a real `aenv server` booting real VMs, driven by the unmodified e2b SDK.

The SDK tests live in `inner/` and run as a child pytest inside the server's network namespace
(see server_ns.py). This test prepares guest images, starts the server, runs them, and fails
with their output if any fails.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from aenv.config import Paths
from aenv.orchestrator import warm
from aenv.orchestrator.images import prepare_images
from tests.e2e import timings
from tests.e2e.restart.in_flight import catalog_states, crash_during
from tests.e2e.server_ns import REPO, ServerNs, server_in_namespace
from tests.e2e.vmm_procs import node_vmm_pids
from tests.support.ci_wheels import ensure_code_interpreter_site
from tests.support.guest import GUEST_CACHE, MIRROR
from tests.support.js import ensure_npm_sdk

OLD_SDK = "2.45.1"
# Run against test_volumes.py's server, in the other lane of `make test`: its hostile guests
# keep the cores busy for a minute, and this lane is the longer one.
EXHAUSTION = "inner/test_exhaustion.py"

# Safety nets, not time budgets: every stage's guests run under TCG, whose speed follows the
# host's (a slow host took 2-5x the usual times for the same steps; beside the rest of the
# suite on such a host, `inner` alone took 51 min and the whole test over an hour).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]


def test_e2b_sdk_against_server() -> None:
    # A short path: VMM control sockets live under the data dir and AF_UNIX caps paths at 107.
    scratch = Path(tempfile.mkdtemp(prefix="aenv-e2e-"))
    start = time.monotonic()
    try:
        _run_inner_suite(scratch / "home")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        timings.record("test_server.py in all", time.monotonic() - start, "")


def _run_inner_suite(home: Path) -> None:
    # The server's namespace has no route to package mirrors or the npm registry: build images
    # (cached) and install the npm SDK from here.
    asyncio.run(prepare_images(Paths(home).cache, GUEST_CACHE, MIRROR))
    ensure_npm_sdk()
    ensure_code_interpreter_site()
    old_sdk_python = _old_sdk_venv()
    with server_in_namespace(home) as server:
        suite(server, "inner", ignore=(EXHAUSTION,))
        suite(server, "old_sdk", python=old_sdk_python)
        # A crash: the server dies with sandboxes running; the next start must report none of
        # them, reclaim their VMMs, slots and files, and serve new ones.
        suite(server, "restart/test_before_crash.py")
        suite(server, "restart/test_before_crash_ops.py")
        server.kill_9()
        server.start()
        suite(server, "restart/test_after_restart.py")
        suite(server, "restart/test_after_crash_ops.py")
        # A graceful stop pauses what runs; after the start it is all resumable.
        suite(server, "restart/test_before_shutdown.py")
        server.stop()
        server.start()
        suite(server, "restart/test_after_shutdown.py")
        # kill -9 while creates, deletes, pauses, snapshots, the pauses and snapshots of
        # resumed sandboxes (mid-stream), the background merges of paused sandboxes' memory
        # layers (mid-write), then a template build are in flight: after the restart the node
        # reports only what runs or is paused, nothing of the cut-short work is left
        # (restart/in_flight.py), and the build is reported failed and then builds.
        works = (
            "creates", "deletes", "pauses", "repauses", "snapshots", "resnapshots", "merges",
            "builds",
        )  # fmt: skip
        for work in works:
            start = time.monotonic()
            print(crash_during(server, work))
            server.start()
            timings.record(f"crash during {work}, restart", time.monotonic() - start, "")
            suite(server, "restart/test_nothing_stale.py")
        suite(server, "restart/test_after_build_crash.py")
        # A full node refuses creates with 429: restarted with room for two more, then without.
        server.stop()
        server.env["AENV_MAX_SANDBOXES"] = str(len(catalog_states(home) or {}) + 2)
        server.start()
        suite(server, "restart/test_capacity.py")
        server.stop()
        del server.env["AENV_MAX_SANDBOXES"]
        _publish_at_start(server)
        _warm_pools(server)
        _hibernation(server)
        server.start()


def _publish_at_start(server: ServerNs) -> None:
    """Publishing code-interpreter-v1 at the start, on a stand-in definition that builds in
    seconds (restart/test_publish.py); off again afterwards, as the other suites expect."""
    server.env["AENV_PUBLISH_CODE_INTERPRETER"] = "true"
    definition = REPO / "tests" / "e2e" / "restart" / "publish" / "template.yaml"
    server.env["AENV_CODE_INTERPRETER_DEFINITION"] = str(definition)
    server.start()
    suite(server, "restart/test_publish.py")
    server.stop()
    server.env["AENV_PUBLISH_CODE_INTERPRETER"] = "false"
    del server.env["AENV_CODE_INTERPRETER_DEFINITION"]


def _warm_pools(server: ServerNs) -> None:
    """Pools on: hits and misses (restart/test_pool.py), then the pooled VMs a kill -9 leaves
    are reclaimed at the start and those a graceful stop finds are stopped with it."""
    server.env["AENV_POOL_MAX"] = "2"
    server.start()
    suite(server, "restart/test_pool.py")
    server.kill_9()
    server.start()
    suite(server, "restart/test_nothing_stale.py")
    suite(server, "restart/test_pool.py::test_pooled_vms_run_but_are_never_listed")
    server.stop()
    assert node_vmm_pids(server.home) == [], "VMMs outlived the graceful stop"
    sandboxes = Paths(server.home).sandboxes
    assert not list(sandboxes.glob(f"*/{warm.MARKER}")), "pooled VMs' files outlived the stop"
    del server.env["AENV_POOL_MAX"]


def _hibernation(server: ServerNs) -> None:
    """Idle hibernation on, after 2 s (restart/test_hibernation.py)."""
    server.env["AENV_HIBERNATE_AFTER"] = "2"
    server.start()
    suite(server, "restart/test_hibernation.py")
    server.stop()
    del server.env["AENV_HIBERNATE_AFTER"]


def _old_sdk_venv() -> str:
    """A virtual environment with e2b 2.45 (v1 create/connect routes), built once under build/.
    The suite's conftest reads the node's paths from `aenv.config`: the venv sees this
    checkout's sources and has pydantic, the one library that module needs."""
    venv = REPO / "build" / f"e2b-{OLD_SDK}"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "aenv-src.pth").write_text(f"{REPO / 'src'}\n")
    if subprocess.run([str(python), "-c", "import e2b, pytest, httpx, aenv.config"]).returncode:
        wanted = [f"e2b=={OLD_SDK}", "pytest", "httpx", f"pydantic=={version('pydantic')}"]
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *wanted], check=True, timeout=600
        )
    return str(python)


def suite(
    server: ServerNs, path: str, python: str = sys.executable, ignore: tuple[str, ...] = ()
) -> None:
    """Run the SDK tests under tests/e2e/`path` (but those of `ignore`) against `server`."""
    start = time.monotonic()
    code, output = server.run(
        python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "--tb=short",
        "--durations=5", "--durations-min=5",
        *(f"--ignore={REPO / 'tests' / 'e2e' / i}" for i in ignore),
        "--rootdir", str(REPO), str(REPO / "tests" / "e2e" / path),
        timeout=4800,
    )  # fmt: skip
    timings.record(path, time.monotonic() - start, output)
    assert code == 0, server.failure(path, output)
