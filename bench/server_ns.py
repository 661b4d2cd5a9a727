"""Shared by the server benchmarks (not a benchmark itself): a real `aenv server` in a network
namespace of its own, and a client script run inside that namespace which prints JSON.

The server is the one `tests/e2e` starts (`tests.e2e.server_ns`): guest images are prepared
from the root namespace first (it has the package mirrors; `AENV_GUEST_CACHE` defaults to
build/guest-cache), the data dir is a short temporary path (VMM control sockets live under it
and AF_UNIX caps paths at 107 bytes) and is removed afterwards with everything in it, as is
the server's memory tree on tmpfs.

Inside the namespace the client reaches the server at http://127.0.0.1:3000; `client_env()`
waits until it answers and returns the E2B_* variables the unmodified SDK needs.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from aenv.config import Config, Paths

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BASE = "http://127.0.0.1:3000"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextmanager
def bench_server(env: Mapping[str, str] | None = None) -> Iterator[Any]:
    """Prepare images, start a server in its own namespace (`env` added to its environment)
    and yield its `tests.e2e.server_ns.ServerNs`; stop it and remove its data dir after."""
    from aenv.orchestrator.images import prepare_images
    from tests.e2e.server_ns import server_in_namespace
    from tests.support.guest import GUEST_CACHE, MIRROR

    scratch = Path(tempfile.mkdtemp(prefix="aenv-b-"))
    home = scratch / "home"
    saved = {k: os.environ.get(k) for k in env or {}}
    try:
        log("preparing guest images (cached)...")
        asyncio.run(prepare_images(Paths(home).cache, GUEST_CACHE, MIRROR))
        # Also in os.environ, for the bench's own client in the namespace.
        os.environ.update(env or {})
        # The node's own defaults, not the e2e suite's economy of 2-4 ready network slots:
        # a fork x16 or a burst would build slots on the spot in the server.
        fields = Config.model_fields
        settings = {
            "AENV_WARM_SLOTS_LOW": str(fields["warm_slots_low"].default),
            "AENV_WARM_SLOTS_HIGH": str(fields["warm_slots_high"].default),
            **(env or {}),
        }
        with server_in_namespace(home, settings=settings) as server:
            try:
                yield server
            finally:
                if keep := os.environ.get("AENV_BENCH_SERVER_LOG"):
                    shutil.copy(server.log, keep)  # for looking into a run afterwards
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        # Template and sandbox memory live on tmpfs, outside the data dir: RAM until removed.
        shutil.rmtree(Paths(home).memory, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


def report(benchmark: str, **fields: Any) -> None:
    """Print a benchmark's JSON document on stdout: its name, today's date, then `fields`."""
    doc = {"benchmark": benchmark, "date": time.strftime("%Y-%m-%d"), **fields}
    print(json.dumps(doc, indent=2))


def entry(main: Callable[[], None], client: Callable[[], None]) -> None:
    """A server benchmark's entry point: `--client` runs its half inside the server's namespace
    (which `run_client` starts), anything else its `main`."""
    if sys.argv[1:2] == ["--client"]:
        client()
    else:
        main()


def run_client(server: Any, argv: list[str], timeout: float) -> dict[str, Any]:
    """Run `argv` inside the server's namespace: its stderr (progress) passes through, its
    stdout must be one JSON document, returned. Fails early, with the end of the server's log,
    when the client fails, times out or the server exits."""
    from tests.e2e.server_ns import in_netns

    with tempfile.TemporaryFile() as out:
        client = subprocess.Popen(in_netns(server.netns, *argv), env=server.env, stdout=out)
        deadline = time.monotonic() + timeout
        why = ""
        while client.poll() is None:
            if server.proc.poll() is not None:
                why = "the server exited"
            elif time.monotonic() > deadline:
                why = f"the client timed out after {timeout:.0f} s"
            if why:
                client.kill()
                client.wait()
                break
            time.sleep(0.5)
        if not why and client.returncode != 0:
            why = f"the client failed (exit code {client.returncode})"
        if why:
            tail = server.log.read_text(errors="replace")[-6000:]
            raise RuntimeError(f"{why}\n--- server log (end) ---\n{tail}")
        out.seek(0)
        result: dict[str, Any] = json.loads(out.read())
        return result


def vmm_processes(home: Path) -> Iterator[Any]:
    """The QEMU processes of the node at `home` (psutil processes)."""
    import psutil

    for proc in psutil.process_iter(["name", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "qemu" in (proc.info["name"] or "") and str(home) in cmdline:
            yield proc


def describe(server: Any) -> dict[str, Any]:
    """What the figures ran on: the VMM the server chose, guest size, host cores."""
    log = server.log.read_text(errors="replace").splitlines()
    vmm = next((line.split("VMM:", 1)[1].strip() for line in log if "VMM:" in line), "")
    return {
        "vmm": vmm,
        "guest_memory_mib": int(server.env["AENV_SANDBOX_MEMORY_MB"]),
        "cores": os.cpu_count(),
    }


def client_env(wait_s: float = 1200) -> dict[str, str]:
    """In the namespace: wait for the server (its first start builds the `base` template) and
    set the SDK's variables in os.environ; returns them."""
    from tests.support.http_wait import wait_until_up

    home = Path(os.environ["AENV_HOME"])
    if not wait_until_up(f"{BASE}/health", wait_s):
        raise RuntimeError("server did not come up:\n" + (home / "server.log").read_text())
    env = {
        "E2B_API_KEY": Paths(home).api_key.read_text().strip(),
        "E2B_API_URL": BASE,
        "E2B_SANDBOX_URL": BASE,
    }
    os.environ.update(env)
    os.environ.pop("E2B_DEBUG", None)
    return env


def dir_size(path: Path) -> dict[str, float]:
    """Bytes a directory tree holds: allocated on disk (sparse files count what they use) and
    apparent (file sizes), in MiB; a file hard-linked twice counts once."""
    allocated = apparent = 0
    seen: set[tuple[int, int]] = set()
    for root, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            allocated += st.st_blocks * 512
            apparent += st.st_size
    return {
        "allocated_mib": round(allocated / 2**20, 2),
        "apparent_mib": round(apparent / 2**20, 2),
    }


def files_mib(path: Path) -> dict[str, float]:
    """Every file under `path` with the MiB it occupies on disk."""
    return {
        str(f.relative_to(path)): round(f.stat().st_blocks * 512 / 2**20, 2)
        for f in sorted(path.rglob("*"))
        if f.is_file()
    }


def metric(name: str, base: str = BASE) -> float:
    """A metric of the server at `base`, summed over its labels."""
    import httpx

    text = httpx.get(f"{base}/metrics", timeout=5).text
    pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.MULTILINE))


def wait_until(check: Callable[[], bool], timeout: float) -> float:
    """Poll `check` every 20 ms until true; the seconds that took. Raises after `timeout`."""
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"still waiting after {timeout:.0f} s")
        time.sleep(0.02)
    return time.perf_counter() - start


def unarchived_pauses(home: Path, sandbox_id: str | None = None) -> int:
    """Paused sandboxes whose checkpoint has no durable repository copy yet (the server pushes
    one in the background after every pause and records it in the catalog row)."""
    db = sqlite3.connect(f"file:{Paths(home).catalog}?mode=ro", uri=True, timeout=10)
    try:
        query = "SELECT COUNT(*) FROM sandboxes WHERE state = 'paused' AND archive_manifest IS NULL"
        params: tuple[str, ...] = ()
        if sandbox_id is not None:
            query += " AND id = ?"
            params = (sandbox_id,)
        return int(db.execute(query, params).fetchone()[0])
    finally:
        db.close()
