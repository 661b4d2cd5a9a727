"""Exhaustion inside guests (issue 14): a fork bomb, a full disk, a full memory, 100,000 files
and 1,000 processes, each in its own victim and all five at once. A victim may fail inside; its
owner gets an answer (a result or an error, never a hang past the command's timeout), and the
node and a bystander sandbox keep answering while all five run, with the host's free disk not
spent past the victim's own disk size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, SandboxException

from tests.e2e.inner.conftest import BASE

# Bounds a hang only: what the guest does within it is not asserted. The hostile processes send
# their output to /dev/null, so the command's stream does not wait for every one of them.
COMMAND_TIMEOUT = 60

# Each attack: (script, user). They run side by side, one victim each, so that the node and the
# bystander are checked under all of them at once (and the suite takes one timeout, not five).
ATTACKS = {
    # The bomb runs on after `timeout` ends its first shell: the victim stays saturated until it
    # is killed at the end of the module.
    "fork_bomb": (
        "timeout -s KILL 10 bash -c 'b() { b | b & }; b' >/dev/null 2>&1; echo done",
        "user",
    ),
    # More than the guest has: the guest's OOM killer ends it (or the command fails).
    # (`tail` keeps a whole newline-less input in memory.)
    "memory_fill": ("head -c 8G /dev/zero | tail > /dev/null || echo refused", "root"),
    # Not zeros, which QEMU unmaps instead of storing; and cheaper than /dev/urandom.
    "disk_fill": (
        "yes aenv-fill | dd of=/home/user/fill bs=1M iflag=fullblock status=none || echo full",
        "root",
    ),
    "100k_files": (
        "mkdir -p /tmp/many && cd /tmp/many && seq 100000 | xargs touch && ls | wc -l",
        "user",
    ),
    "1000_processes": (
        "for i in $(seq 1000); do sleep 120 >/dev/null 2>&1 & done; "
        "ps -e --no-headers | wc -l; kill $(jobs -p) 2>/dev/null; true",
        "user",
    ),
}


@dataclass
class Attack:
    victim: Sandbox
    outcome: Future[str]

    def result(self) -> str:
        """The attack's output, or "error: ..." (a non-zero exit, a timeout, a guest that gave
        out); never a hang: the command's own timeout bounds it."""
        return self.outcome.result(timeout=COMMAND_TIMEOUT + 120)


@pytest.fixture(scope="module")
def bystander() -> Iterator[Sandbox]:
    sandbox = Sandbox.create(timeout=900)
    sandbox.files.write("/tmp/state", "kept")
    yield sandbox
    sandbox.kill()


@pytest.fixture(scope="module")
def attacks(bystander: Sandbox) -> Iterator[dict[str, Attack]]:
    victims: dict[str, Sandbox] = {}
    try:
        for name in ATTACKS:
            victims[name] = Sandbox.create(timeout=600)
        with ThreadPoolExecutor(len(ATTACKS)) as pool:
            yield {
                name: Attack(
                    victims[name], pool.submit(_run_hostile, victims[name], *ATTACKS[name])
                )
                for name in ATTACKS
            }
    finally:
        for victim in victims.values():
            victim.kill()


def _node_and_bystander_answer(bystander: Sandbox) -> None:
    assert httpx.get(f"{BASE}/health", timeout=30).is_success
    assert bystander.files.read("/tmp/state") == "kept"
    assert bystander.commands.run("echo alive", timeout=60).stdout == "alive\n"


def _host_bytes(sandbox: Sandbox) -> int:
    """Disk space the sandbox's files take on the host (allocated blocks, not apparent sizes)."""
    work = Path(os.environ["AENV_HOME"]) / "sandboxes" / sandbox.sandbox_id
    return sum(f.stat().st_blocks * 512 for f in work.rglob("*") if f.is_file())


def _run_hostile(victim: Sandbox, script: str, user: str) -> str:
    """Run `script` in the victim; its outcome (output or error) as text, never a hang."""
    try:
        result = victim.commands.run(script, user=user, timeout=COMMAND_TIMEOUT)
    except SandboxException as e:
        return f"error: {e}"
    return result.stdout


def test_node_answers_while_all_run(attacks: dict[str, Attack], bystander: Sandbox) -> None:
    _node_and_bystander_answer(bystander)


def test_fork_bomb(attacks: dict[str, Attack], bystander: Sandbox) -> None:
    attacks["fork_bomb"].result()
    _node_and_bystander_answer(bystander)


def test_memory_fill(attacks: dict[str, Attack], bystander: Sandbox) -> None:
    out = attacks["memory_fill"].result()
    assert "refused" in out or out.startswith("error")
    _node_and_bystander_answer(bystander)


def test_disk_fill(attacks: dict[str, Attack], bystander: Sandbox) -> None:
    attack = attacks["disk_fill"]
    out = attack.result()
    assert "full" in out or out.startswith("error")
    victim = attack.victim
    disk_bytes = int(victim.commands.run("df -B1 --output=size / | tail -1").stdout)
    # The guest's writes land in its writable layer on the host, bounded by its disk's size
    # (plus the layer format's own metadata).
    assert _host_bytes(victim) <= disk_bytes * 1.05
    _node_and_bystander_answer(bystander)
    # The full guest still answers, and freeing the file frees its disk.
    victim.commands.run("rm /home/user/fill", user="root", timeout=COMMAND_TIMEOUT)
    assert victim.commands.run("echo ok > /home/user/after && cat /home/user/after").stdout == (
        "ok\n"
    )


def test_100k_files(attacks: dict[str, Attack], bystander: Sandbox) -> None:
    out = attacks["100k_files"].result()
    assert out.strip() == "100000" or out.startswith("error")
    _node_and_bystander_answer(bystander)


def test_1000_processes(attacks: dict[str, Attack], bystander: Sandbox) -> None:
    out = attacks["1000_processes"].result()
    assert out.startswith("error") or int(out.split()[0]) >= 1000
    _node_and_bystander_answer(bystander)
