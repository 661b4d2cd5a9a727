"""RL rollouts (issue 35): episodes per minute of N parallel workers, each episode a reset to one
prepared state, 5 commands and a score, with the reset done in place (`aenv.sdk.reset`, one
sandbox per worker for the whole run) against a create from the snapshot and a kill per episode
(what the E2B API alone offers). A real `aenv server` with real VMs, driven by the unmodified
`e2b` SDK from inside the server's network namespace (see server_ns.py); both ways in one run,
in alternating rounds so that the host's load falls on both alike.

- The prepared state: a sandbox of `base` with a task file written and a background process
  holding a value in memory, saved once as a snapshot (untimed).
- An episode: reset (in place: `reset(sandbox, snapshot)`; or `Sandbox.create(snapshot)`),
  then 5 commands (the agent's actions: each appends to a file and reads it back), then the
  score (a command that counts the lines and checks the memory's value survived), then, for
  create+kill, `kill`. Its time is from the reset's start to the score (and the kill).
- Per way: episodes per minute over all workers (episodes done / wall time of the rounds), the
  time of an episode, of its reset step (the reset, or the create) and of the kill, min /
  median / p99 / max in ms, and failures. Two ratios: episodes per minute, reset in place over
  create+kill (the figure); and the medians of create + kill over the reset step (what the
  reset itself saves, the episode's commands aside).

Settings (environment): AENV_BENCH_WORKERS (2), AENV_BENCH_ROUND_S (60: seconds per way and
round), AENV_BENCH_ROUNDS (2). Prints one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server_ns import bench_server, client_env, describe, entry, log, report, run_client
from summary import summary_ms


def setting(name: str, default: float) -> float:
    return float(os.environ.get(f"AENV_BENCH_{name}", default))


WORKERS = int(setting("WORKERS", 2))
ROUND_S = setting("ROUND_S", 60)
ROUNDS = int(setting("ROUNDS", 2))
ACTIONS = 5
# The background process of the prepared state: its value lives in its memory (and a file).
HOLDER = "bash -c 'v=$RANDOM$RANDOM; echo $v > /tmp/value; exec sleep 100000'"


@dataclass
class Tally:
    """One way's figures over every round."""

    episodes: list[float] = field(default_factory=list)  # seconds each
    resets: list[float] = field(default_factory=list)  # seconds of its reset step
    kills: list[float] = field(default_factory=list)  # seconds of its kill (create+kill)
    failures: list[str] = field(default_factory=list)
    wall: float = 0.0

    def figures(self) -> dict[str, Any]:
        return {
            "episodes": len(self.episodes),
            "seconds": round(self.wall, 1),
            "episodes_per_min": round(len(self.episodes) / self.wall * 60, 2),
            "episode_ms": summary_ms(self.episodes) if self.episodes else None,
            "reset_ms": summary_ms(self.resets) if self.resets else None,
            "kill_ms": summary_ms(self.kills) if self.kills else None,
            "failures": len(self.failures),
            "first_failures": self.failures[:5],
        }


def prepare() -> tuple[str, str]:
    """The prepared state: a snapshot, and the value its memory holds."""
    from e2b import Sandbox

    sandbox = Sandbox.create(timeout=3600, metadata={"bench": "rollouts"})
    sandbox.files.write("/home/user/task.txt", "the task\n")
    sandbox.commands.run(HOLDER, background=True)
    sandbox.commands.run("while [ ! -s /tmp/value ]; do sleep 0.05; done", timeout=120)
    value = sandbox.commands.run("cat /tmp/value").stdout.strip()
    snapshot = sandbox.create_snapshot(name="rollouts-prepared")
    sandbox.kill()
    return snapshot.snapshot_id, value


def play(sandbox: Any, value: str) -> None:
    """The episode's actions and its score; fails when the state was not the prepared one."""
    for step in range(ACTIONS):
        sandbox.commands.run(
            f"echo step {step} >> /home/user/episode.txt && tail -1 /home/user/episode.txt"
        )
    score = sandbox.commands.run(
        f"test $(cat /tmp/value) = {value} && pgrep -f '^sleep 10000[0]$' >/dev/null"
        " && wc -l < /home/user/episode.txt"
    )
    if score.stdout.strip() != str(ACTIONS):
        raise AssertionError(f"score {score.stdout.strip()!r}: the episode did not start afresh")


def in_place(snapshot: str, value: str) -> Callable[[Tally, float], None]:
    """A worker that resets its own sandbox in place each episode."""
    from e2b import Sandbox

    from aenv.sdk import reset

    def worker(tally: Tally, stop: float) -> None:
        sandbox = Sandbox.create(snapshot, timeout=3600)
        try:
            while time.monotonic() < stop:
                start = time.perf_counter()
                try:
                    reset(sandbox, snapshot)
                    tally.resets.append(time.perf_counter() - start)
                    play(sandbox, value)
                except Exception as e:  # reported: a failed episode is a result too
                    tally.failures.append(repr(e)[:300])
                    continue
                tally.episodes.append(time.perf_counter() - start)
        finally:
            sandbox.kill()

    return worker


def create_kill(snapshot: str, value: str) -> Callable[[Tally, float], None]:
    """A worker that creates a sandbox from the snapshot and kills it each episode."""
    from e2b import Sandbox

    def worker(tally: Tally, stop: float) -> None:
        while time.monotonic() < stop:
            start = time.perf_counter()
            sandbox = None
            try:
                sandbox = Sandbox.create(snapshot, timeout=600)
                tally.resets.append(time.perf_counter() - start)
                play(sandbox, value)
                killing = time.perf_counter()
                sandbox.kill()
                tally.kills.append(time.perf_counter() - killing)
                sandbox = None
            except Exception as e:
                tally.failures.append(repr(e)[:300])
                continue
            finally:
                if sandbox is not None:
                    sandbox.kill()
            tally.episodes.append(time.perf_counter() - start)

    return worker


def run_round(worker: Callable[[Tally, float], None], tally: Tally) -> None:
    """`WORKERS` threads running `worker` for `ROUND_S` seconds; each ends its last episode."""
    start = time.perf_counter()
    stop = time.monotonic() + ROUND_S
    threads = [threading.Thread(target=worker, args=(tally, stop)) for _ in range(WORKERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tally.wall += time.perf_counter() - start


def client() -> None:
    client_env()
    log("preparing the snapshot...")
    snapshot, value = prepare()
    ways = {
        "reset_in_place": in_place(snapshot, value),
        "create_kill": create_kill(snapshot, value),
    }
    tallies = {name: Tally() for name in ways}
    for round_no in range(ROUNDS):
        # Alternate which goes first: a host whose load drifts weighs on both alike.
        order = list(ways) if round_no % 2 == 0 else list(reversed(ways))
        for name in order:
            log(f"round {round_no + 1}/{ROUNDS}: {name}, {WORKERS} workers, {ROUND_S:.0f} s...")
            run_round(ways[name], tallies[name])
            log(f"  {len(tallies[name].episodes)} episodes so far")
    print(json.dumps({name: tally.figures() for name, tally in tallies.items()}))


def main() -> None:
    with bench_server() as server:
        runs = run_client(server, [sys.executable, __file__, "--client"], timeout=7200)
        machine = describe(server)
    per_min = {name: runs[name]["episodes_per_min"] for name in runs}
    # What the reset replaces: a create and a kill, against the reset step alone (medians).
    created, reset = runs["create_kill"], runs["reset_in_place"]
    lifecycle = created["reset_ms"]["median"] + created["kill_ms"]["median"]
    report(
        "rollouts",
        **machine,
        workers=WORKERS,
        round_s=ROUND_S,
        rounds=ROUNDS,
        actions_per_episode=ACTIONS,
        **runs,
        ratio_reset_over_create_kill=round(per_min["reset_in_place"] / per_min["create_kill"], 3),
        ratio_create_kill_over_reset_step=round(lifecycle / reset["reset_ms"]["median"], 3),
    )


if __name__ == "__main__":
    entry(main, client)
