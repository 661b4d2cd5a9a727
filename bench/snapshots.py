"""Pause, resume, snapshot and fork benchmarks (issue 5): a real `aenv server` with real VMs,
driven by the unmodified `e2b` Python SDK from inside the server's network namespace (see
server_ns.py). The snapshot repository has its own benchmark (bench/repository.py).

Each run, on sandboxes freshly created from the `base` template:
- sandbox A: `pause()`; what the pause wrote (the sandbox's `pause-*` checkpoint dirs under
  `$AENV_HOME/sandboxes/<id>/`: device state with RAM, sealed disk layers); resume, which is
  `Sandbox.connect()` of the paused sandbox, and the first `commands.run("true")` after it;
- sandbox B: `create_snapshot()` while it runs (and the MiB it wrote), then
  `fork(count=16)`: all 16 children created (total, and per child = total / 16).

After a pause or a snapshot the server copies it to the snapshot repository in the background;
the bench waits for that copy (read from the catalog row / the snapshot's template.json) before
the next timed operation, and reports how long after the call it was durable (`*_durable`).

Then the real sequences of issue 18, where background work has not finished or the sandbox is no
longer fresh (`sequences`):
- `pause()` then `Sandbox.connect()` at once, and the same 2 s after the pause;
- a sandbox paused and resumed three times, then `create_snapshot()` and `fork(count=16)`;
- a resumed sandbox whose guest then writes 16 / 64 / 256 MiB into its tmpfs: `create_snapshot()`
  and `pause()` after that;
- AENV_BENCH_CYCLES (100) pause/connect cycles of one sandbox with a process started before the
  first: checked alive at every resume, with a file's content; first / last tenth, and the 1st,
  middle (50th of 100) and last cycle's pause, resume and bytes as they were.
Every save reports the bytes it wrote (allocated MiB of what it left on disk) next to its time.
Where the time of a connect at once, a snapshot and a fork of the resumed sandbox goes is read
from the server's step log lines (`server_steps.py`): per run, the median of each step.

Baseline: the plain `Sandbox.create()` of A and B, measured in the same run; ratios are medians
over that baseline's median. min / median / max (and p99) over AENV_BENCH_RUNS runs (5);
AENV_BENCH_FORKS sets the fork count (16), AENV_BENCH_GUEST_MIB the guest's RAM (512). Prints
one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from server_ns import (
    bench_server,
    client_env,
    describe,
    dir_size,
    entry,
    files_mib,
    log,
    report,
    run_client,
    unarchived_pauses,
    wait_until,
)
from server_steps import LogStretch
from summary import summary_ms

from aenv.config import Paths

RUNS = int(os.environ.get("AENV_BENCH_RUNS", "5"))
FORKS = int(os.environ.get("AENV_BENCH_FORKS", "16"))
CYCLES = int(os.environ.get("AENV_BENCH_CYCLES", "100"))
# What the guest writes before the saves of the write sequence (AENV_BENCH_WRITES_MIB="" skips).
WRITES_MIB = [int(m) for m in os.environ.get("AENV_BENCH_WRITES_MIB", "16,64,256").split(",") if m]
GUEST_MIB = os.environ.get("AENV_BENCH_GUEST_MIB", "512")
_QUEUED = re.compile(r"create from \S+: (?P<queued>\d+) ms in the queue")
TARGETS_MS = {"pause": 200, "resume": 300, "snapshot": 300, "fork_total": 4000}


def timed(op: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = op()
    return time.perf_counter() - start, result


def pause_files(sandbox_dir: Path) -> dict[str, Any]:
    """What the pause left in the sandbox's directory: its `pause-*` checkpoint(s)."""
    dirs = sorted(sandbox_dir.glob("pause-*"))
    files = {f"{d.name}/{name}": mib for d in dirs for name, mib in files_mib(d).items()}
    total = {"allocated_mib": 0.0, "apparent_mib": 0.0}
    for d in dirs:
        for key, value in dir_size(d).items():
            total[key] = round(total[key] + value, 2)
    return {**total, "files_mib": files}


def one_run(home: Path, run: int) -> dict[str, Any]:
    from e2b import Sandbox

    samples: dict[str, Any] = {"create": []}
    # A: pause and resume.
    took, a = timed(lambda: Sandbox.create(timeout=600))
    samples["create"].append(took)
    a.commands.run("true")
    samples["pause"], paused = timed(a.pause)
    paused_at = time.perf_counter()
    assert paused is True
    samples["pause_written"] = pause_files(Paths(home).sandboxes / a.sandbox_id)
    # The server then copies the checkpoint to the snapshot repository in the background; let
    # it finish, so the resume below is measured alone.
    wait_until(lambda: unarchived_pauses(home, a.sandbox_id) == 0, 600)
    samples["pause_durable"] = time.perf_counter() - paused_at
    samples["resume"], a = timed(lambda: Sandbox.connect(a.sandbox_id, timeout=600))
    samples["first_command_after_resume"] = timed(lambda: a.commands.run("true"))[0]
    a.kill()
    # B: snapshot and fork.
    took, b = timed(lambda: Sandbox.create(timeout=600))
    samples["create"].append(took)
    b.commands.run("true")
    samples["snapshot"], info = timed(b.create_snapshot)
    snapshot_at = time.perf_counter()
    samples["snapshot_size"] = snapshot_written_mib(home, info.snapshot_id)
    template_file = Paths(home).templates / info.snapshot_id / "template.json"
    wait_until(lambda: json.loads(template_file.read_text()).get("manifest_id") is not None, 600)
    samples["snapshot_durable"] = time.perf_counter() - snapshot_at
    Sandbox.delete_snapshot(info.snapshot_id)
    samples["fork_total"], children = timed(lambda: b.fork(count=FORKS, timeout=600))
    errors = [c for c in children if not isinstance(c, Sandbox)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda c: c.kill(), [c for c in children if isinstance(c, Sandbox)]))
    b.kill()
    if errors:
        raise RuntimeError(f"fork: {len(errors)} of {FORKS} children failed: {errors[:3]}")
    log(
        f"run {run}: create {samples['create'][0] * 1000:.0f}/{took * 1000:.0f} ms, "
        f"pause {samples['pause'] * 1000:.0f} ms ({samples['pause_written']['allocated_mib']}"
        f" MiB), resume {samples['resume'] * 1000:.0f} ms, snapshot "
        f"{samples['snapshot'] * 1000:.0f} ms, fork x{FORKS} {samples['fork_total']:.2f} s"
    )
    return samples


def snapshot_and_wait(home: Path, sandbox: Any) -> tuple[float, float]:
    """`create_snapshot()`: the seconds it took and the MiB it wrote; waits for its repository
    copy and deletes it (its files go once nothing uses them)."""
    from e2b import Sandbox

    took, info = timed(sandbox.create_snapshot)
    written = snapshot_written_mib(home, info.snapshot_id)
    template_file = Paths(home).templates / info.snapshot_id / "template.json"
    wait_until(lambda: json.loads(template_file.read_text()).get("manifest_id") is not None, 600)
    Sandbox.delete_snapshot(info.snapshot_id)
    return took, written


def snapshot_written_mib(home: Path, snapshot_id: str) -> float:
    """MiB a snapshot wrote: its directory but for the older memory layers linked into it (a
    layered state lies over the states its sandbox was restored from: no bytes), and its memory
    file on tmpfs unless that is a hard link to the file it was saved over (a changed-pages
    snapshot links its base: no bytes)."""
    paths = Paths(home)
    # Its builds, not the `<build>.upload` copy its repository upload may be staging already.
    builds = [d for d in (paths.templates / snapshot_id).iterdir() if d.suffix != ".upload"]
    written = sum(dir_size(build)["allocated_mib"] for build in builds)
    for layer in (paths.templates / snapshot_id).glob("*/layer-*"):
        st = layer.stat()
        if st.st_nlink > 1:
            written -= st.st_blocks * 512 / 2**20
    for memory in (paths.memory / snapshot_id).glob("*/memory"):
        st = memory.stat()
        if st.st_nlink == 1:
            written += st.st_blocks * 512 / 2**20
    return round(written, 2)


def pause_and_measure(home: Path, sandbox: Any) -> tuple[float, float]:
    """`pause()`: the seconds it took and the MiB its newest checkpoint holds when it returns."""
    took, paused = timed(sandbox.pause)
    assert paused is True
    sandbox_dir = Paths(home).sandboxes / sandbox.sandbox_id
    newest = max(sandbox_dir.glob("pause-*"), key=lambda d: int(d.name.split("-")[1]))
    return took, dir_size(newest)["allocated_mib"]


def kill_all(sandboxes: list[Any]) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda c: c.kill(), sandboxes))


def sequences(home: Path, run: int, steps: dict[str, Any]) -> dict[str, Any]:
    """The sequences of issue 18 (see the module docstring), one pass; the server's step
    timings of some into `steps`."""
    from e2b import Sandbox

    out: dict[str, Any] = {}
    server_log = home / "server.log"
    for name, delay in (("connect_at_once", 0.0), ("connect_after_2s", 2.0)):
        sandbox = Sandbox.create(timeout=600)
        sandbox.commands.run("true")
        out[f"pause_before_{name}"], _ = pause_and_measure(home, sandbox)
        time.sleep(delay)
        stretch = LogStretch(server_log)
        out[name], sandbox = timed(partial(Sandbox.connect, sandbox.sandbox_id, timeout=600))
        steps[name] = {
            "resume": stretch.steps("resume of"),
            "sandbox": stretch.steps("started sandbox"),
            "vm": stretch.steps("restored VM"),
        }
        out[f"first_command_after_{name}"] = timed(partial(sandbox.commands.run, "true"))[0]
        sandbox.kill()
    # Resumed three times, then snapshot and fork.
    sandbox = Sandbox.create(timeout=600)
    for _ in range(3):
        pause_and_measure(home, sandbox)
        sandbox = Sandbox.connect(sandbox.sandbox_id, timeout=600)
        sandbox.commands.run("true")
    stretch = LogStretch(server_log)
    out["resumed3_snapshot"], out["resumed3_snapshot_mib"] = snapshot_and_wait(home, sandbox)
    steps["resumed3_snapshot"] = {
        "checkpoint": stretch.steps("checkpoint of"),
        "vm": stretch.steps("snapshot of VM"),
        "save": stretch.saves(),
    }
    stretch = LogStretch(server_log)
    out["resumed3_fork_total"], children = timed(lambda: sandbox.fork(count=FORKS, timeout=600))
    steps["resumed3_fork"] = {
        "fork": stretch.forks(),
        "checkpoint": stretch.steps("checkpoint of"),
        "children": stretch.steps("started sandbox"),
        "vms": stretch.steps("restored VM"),
        "queued": stretch.figures(_QUEUED),
    }
    failed = [c for c in children if not isinstance(c, Sandbox)]
    kill_all([c for c in children if isinstance(c, Sandbox)] + [sandbox])
    if failed:
        raise RuntimeError(f"fork: {len(failed)} of {FORKS} children failed: {failed[:3]}")
    # A resumed sandbox whose guest writes N MiB.
    for mib in WRITES_MIB:
        sandbox = Sandbox.create(timeout=600)
        pause_and_measure(home, sandbox)
        sandbox = Sandbox.connect(sandbox.sandbox_id, timeout=600)
        # The guest's /dev/shm is half its RAM by default: room for 256 MiB made first.
        sandbox.commands.run("mount -o remount,size=90% /dev/shm", user="root")
        fill = f"head -c {mib}M /dev/zero | tr '\\000' x > /dev/shm/fill"
        sandbox.commands.run(fill, timeout=600)
        out[f"write{mib}_snapshot"], out[f"write{mib}_snapshot_mib"] = snapshot_and_wait(
            home, sandbox
        )
        out[f"write{mib}_pause"], out[f"write{mib}_pause_mib"] = pause_and_measure(home, sandbox)
        Sandbox.kill(sandbox.sandbox_id)
    log(
        f"sequences {run}: connect at once {out['connect_at_once'] * 1000:.0f} ms, after 2 s "
        f"{out['connect_after_2s'] * 1000:.0f} ms; resumed x3: snapshot "
        f"{out['resumed3_snapshot'] * 1000:.0f} ms ({out['resumed3_snapshot_mib']} MiB), fork "
        f"{out['resumed3_fork_total']:.2f} s"
    )
    return out


def cycles(home: Path) -> dict[str, Any]:
    """CYCLES pause/connect cycles of one sandbox; a process and a file checked at every resume."""
    from e2b import Sandbox

    sandbox = Sandbox.create(timeout=3600)
    sandbox.files.write("/home/user/kept", "kept across cycles")
    # timeout=0: the SDK's default 60 s bounds the process's life (envd kills it then), which
    # ended an earlier 100-cycle run at cycle 50 with a lost process that was only that.
    pid = sandbox.commands.run("sleep 100000", background=True, timeout=0).pid
    pauses: list[float] = []
    resumes: list[float] = []
    written: list[float] = []
    for cycle in range(CYCLES):
        took, mib = pause_and_measure(home, sandbox)
        pauses.append(took)
        written.append(mib)
        took, sandbox = timed(partial(Sandbox.connect, sandbox.sandbox_id, timeout=3600))
        resumes.append(took)
        check = f"kill -0 {pid} 2>/dev/null && echo alive; cat /home/user/kept"
        alive = sandbox.commands.run(check).stdout
        if alive != "alive\nkept across cycles":
            # Reported, not raised: the figures of the other sequences are kept.
            log(f"cycle {cycle + 1}: process or file lost: {alive!r}")
            lost = {"lost_at_cycle": cycle + 1, "what_remained": alive}
            break
    else:
        lost = {}
    sandbox.kill()
    log(f"{CYCLES} cycles: resume first {resumes[0] * 1000:.0f} ms, last {resumes[-1] * 1000:.0f}")
    tenth = max(1, CYCLES // 10)
    # The 1st, the middle and the last cycle as they were, next to the medians.
    marks = sorted({1, (CYCLES + 1) // 2, CYCLES} & set(range(1, len(resumes) + 1)))
    return {
        "cycles": len(resumes),
        **lost,
        "at_cycle": {
            str(n): {
                "pause_ms": round(pauses[n - 1] * 1000, 1),
                "resume_ms": round(resumes[n - 1] * 1000, 1),
                "pause_written_mib": written[n - 1],
            }
            for n in marks
        },
        "pause_ms": summary_ms(pauses),
        "resume_ms": summary_ms(resumes),
        "first_tenth_resume_median_ms": round(statistics.median(resumes[:tenth]) * 1000, 1),
        "last_tenth_resume_median_ms": round(statistics.median(resumes[-tenth:]) * 1000, 1),
        "pause_written_mib": summary_ms(written, 1),
        # Every cycle's: layers over the last save, and every few a delta against the base.
        "pause_written_mib_each": written,
        "first_tenth_pause_mib": round(statistics.median(written[:tenth]), 2),
        "last_tenth_pause_mib": round(statistics.median(written[-tenth:]), 2),
    }


def client() -> None:
    """Runs inside the server's namespace."""
    from importlib.metadata import version

    from e2b import Sandbox

    client_env()
    home = Path(os.environ["AENV_HOME"])
    warm = Sandbox.create(timeout=120)  # the first create after start warms caches
    warm.commands.run("true")
    warm.kill()
    log(f"server up; {RUNS} runs...")
    runs = [one_run(home, i + 1) for i in range(RUNS)]
    creates = [c for r in runs for c in r["create"]]
    base = statistics.median(creates)
    result: dict[str, Any] = {
        "sdk": f"e2b {version('e2b')}",
        "runs": RUNS,
        "forks": FORKS,
        "baseline_create_ms": summary_ms(creates),
    }
    names = (
        "pause",
        "pause_durable",
        "resume",
        "first_command_after_resume",
        "snapshot",
        "snapshot_durable",
        "fork_total",
    )
    for name in names:
        values = [r[name] for r in runs]
        entry: dict[str, Any] = {
            "ms": summary_ms(values),
            "ratio_to_create": round(statistics.median(values) / base, 3),
        }
        if name in TARGETS_MS:
            entry["target_ms"] = TARGETS_MS[name]
            entry["median_meets_target"] = statistics.median(values) * 1000 <= TARGETS_MS[name]
        result[name] = entry
    result["fork_per_child_ms"] = summary_ms([r["fork_total"] / FORKS for r in runs])
    result["pause_written"] = {
        "allocated_mib": summary_ms([r["pause_written"]["allocated_mib"] for r in runs], 1),
        "first_run_files_mib": runs[0]["pause_written"]["files_mib"],
    }
    result["snapshot_size_mib"] = summary_ms([r["snapshot_size"] for r in runs], 1)
    steps: list[dict[str, Any]] = [{} for _ in range(RUNS)]
    seqs = [sequences(home, i + 1, steps[i]) for i in range(RUNS)]
    for name in seqs[0]:
        values = [s[name] for s in seqs]
        if name.endswith("_mib"):
            result[name] = summary_ms(values, 1)
        else:
            result[name] = {
                "ms": summary_ms(values),
                "ratio_to_create": round(statistics.median(values) / base, 3),
            }
    result["server_steps_ms"] = steps
    if CYCLES:
        result["cycles"] = cycles(home)
    print(json.dumps(result))


def main() -> None:
    # The figures are for 512 MiB guests (the test server's default is 256), which
    # also leaves the guest room for the 256 MiB write.
    with bench_server({"AENV_SANDBOX_MEMORY_MB": GUEST_MIB}) as server:
        result = run_client(server, [sys.executable, __file__, "--client"], timeout=3600)
        machine = describe(server)
    report("snapshots", **machine, **result)


if __name__ == "__main__":
    entry(main, client)
