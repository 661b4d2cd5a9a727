"""Warm pools on real VMs, against a server started with `AENV_POOL_MAX=2` (test_server.py):
a miss refills the pool, the next creates are hits, each pooled sandbox gets its own identity
and randomness at the take, pooled VMs run but are never listed. The module ends with the pool
full, so that the kill -9 which follows leaves pooled VMMs for the restart to reclaim."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import httpx
from e2b import Sandbox

from tests.e2e.inner.conftest import BASE
from tests.e2e.vmm_procs import vmm_sandbox_ids

HOME = Path(os.environ["AENV_HOME"])
POOL_MAX = int(os.environ["AENV_POOL_MAX"])
RANDOM = "head -c 16 /dev/urandom | od -An -tx1"


def metric(name: str) -> float:
    """The sum of a metric over its labels."""
    text = httpx.get(f"{BASE}/metrics").text
    pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.MULTILINE))


def wait_pooled(count: int) -> None:
    for _ in range(600):
        if metric("aenv_pool_vms") >= count:
            return
        time.sleep(0.5)
    raise AssertionError(f"the pool never held {count} VMs")


def test_a_miss_then_hits_with_fresh_identity() -> None:
    misses, hits = metric("aenv_pool_misses_total"), metric("aenv_pool_hits_total")
    first = Sandbox.create(timeout=120)
    assert metric("aenv_pool_misses_total") == misses + 1
    sandboxes = [first]
    try:
        for who in ("a", "b"):
            wait_pooled(1)
            sandboxes.append(Sandbox.create(timeout=120, envs={"WHO": who}))
        assert metric("aenv_pool_hits_total") == hits + 2
        a, b = sandboxes[1:]
        seen = []
        for sandbox, who in ((a, "a"), (b, "b")):
            assert sandbox.commands.run("hostname").stdout.strip() == sandbox.sandbox_id
            assert sandbox.commands.run("echo $WHO").stdout.strip() == who
            seen.append(sandbox.commands.run(RANDOM).stdout)
        assert seen[0] != seen[1]  # the RNG was reseeded at each take
        assert a._envd_access_token and a._envd_access_token != b._envd_access_token
    finally:
        for sandbox in sandboxes:
            sandbox.kill()


def test_pooled_vms_run_but_are_never_listed() -> None:
    mine = [Sandbox.create(timeout=120) for _ in range(POOL_MAX)]  # creates size the pool
    try:
        wait_pooled(POOL_MAX)
        listed = {s.sandbox_id for s in Sandbox.list().next_items()}
        assert {s.sandbox_id for s in mine} <= listed
        pooled = vmm_sandbox_ids(HOME) - listed
        assert len(pooled) >= POOL_MAX, "the pooled VMMs are not running"
        for sandbox_id in pooled:
            assert (HOME / "sandboxes" / sandbox_id / "pooled").exists()
    finally:
        for sandbox in mine:
            sandbox.kill()
    wait_pooled(POOL_MAX)  # full for the kill -9 or stop that follows
