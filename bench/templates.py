"""Template benchmarks (issue 6): image pulls, template builds and sandboxes from a built template.

1. Pull (no server): a 5-layer image written in the bench (an OCI layout as `tests/oci` makes
   them: each layer one file of random bytes, gzip, so nothing compresses and every byte is
   fetched, hashed and written) is pushed with skopeo to Debian's `docker-registry` on loopback
   and pulled with `aenv.oci.pull`: cold (an empty blob cache each run) and again with the
   cache it filled (warm). Baseline in the same run: the same five blobs fetched concurrently
   with plain httpx and thrown away (no digest check, no disk).
2. Build, through a real `aenv server` in its own network namespace (see server_ns.py) with the
   unmodified `e2b` SDK inside it: a 3-step template from `base` (RUN writing a file, COPY of a
   small directory, RUN another command). Cold: the first step and the copied files differ in
   every run, so nothing is cached. Rebuild: the same template with only the last RUN changed;
   the server's step cache skips the RUN and the COPY. Each build is split into phases from the
   build log's timestamps (server and client share the clock).
3. Create: `Sandbox.create()` from the template just built vs from `base`, interleaved, and the
   first `commands.run("true")` in each; once after the cold build and once after the rebuild
   (the two are saved differently: `saved_*` says whether the template's RAM is a memory file
   that restores map, or inside the state stream that every restore loads).

AENV_BENCH_RUNS sets the build runs (3), AENV_BENCH_PULL_RUNS the pull runs (5),
AENV_BENCH_CREATES the creates of each kind per build run (5), AENV_BENCH_LAYER_MIB the size of
each layer (8). min / median / max (and p99) as in bench/summary.py. One JSON document on
stdout; progress on stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from server_ns import bench_server, client_env, describe, dir_size, entry, log, report, run_client
from summary import summary_ms

from aenv.config import Paths

RUNS = int(os.environ.get("AENV_BENCH_RUNS", "3"))
PULL_RUNS = int(os.environ.get("AENV_BENCH_PULL_RUNS", "5"))
CREATES = int(os.environ.get("AENV_BENCH_CREATES", "5"))
LAYER_MIB = int(os.environ.get("AENV_BENCH_LAYER_MIB", "8"))
LAYERS = 5


# --- 1. pull -------------------------------------------------------------------------------


def five_layer_layout(root: Path) -> Any:
    """An OCI layout holding `five:v1`: LAYERS layers of LAYER_MIB MiB of random bytes each."""
    from tests.oci.images import Image, Layout, directory, entry

    layers = [
        [directory("data"), entry(f"data/layer{i}.bin", os.urandom(LAYER_MIB << 20))]
        for i in range(LAYERS)
    ]
    layout = Layout(root)
    layout.add("v1", Image(layers, config={"Env": ["PATH=/usr/bin:/bin"]}))
    return layout


async def raw_fetch(host: str, repo: str, layers: list[tuple[str, int]]) -> int:
    """The baseline: every layer blob GET at once with plain httpx, bytes discarded."""
    import httpx

    async with httpx.AsyncClient(timeout=120) as http:

        async def get(digest: str) -> int:
            got = 0
            url = f"http://{host}/v2/{repo}/blobs/{digest}"
            async with http.stream("GET", url) as response:
                response.raise_for_status()
                async for chunk in response.aiter_raw():
                    got += len(chunk)
            return got

        sizes = await asyncio.gather(*(get(d) for d, _ in layers))
    assert sizes == [s for _, s in layers], sizes
    return sum(sizes)


def bench_pull() -> dict[str, Any]:
    from aenv.oci.pull import pull
    from tests.oci.images import push
    from tests.oci.registry import run_registry

    scratch = Path(tempfile.mkdtemp(prefix="aenv-bt-"))
    try:
        with run_registry(scratch / "registry") as registry:
            log(f"pull: writing and pushing a {LAYERS}-layer image ({LAYER_MIB} MiB each)...")
            layout = five_layer_layout(scratch / "layout")
            repo = "bench/five"
            ref = f"{registry.host}/{repo}:v1"
            push(layout, "v1", ref)
            cold: list[float] = []
            warm: list[float] = []
            raw: list[float] = []
            layers: list[tuple[str, int]] = []
            for run in range(PULL_RUNS):
                cache = scratch / f"cache-{run}"
                start = time.perf_counter()
                image = asyncio.run(pull(ref, cache))
                cold.append(time.perf_counter() - start)
                layers = [(layer.digest, layer.size) for layer in image.layers]
                assert len(layers) == LAYERS and all(cache.glob("blobs/sha256/*"))
                start = time.perf_counter()
                again = asyncio.run(pull(ref, cache))
                warm.append(time.perf_counter() - start)
                assert again.digest == image.digest
                start = time.perf_counter()
                asyncio.run(raw_fetch(registry.host, repo, layers))
                raw.append(time.perf_counter() - start)
                shutil.rmtree(cache)
                log(
                    f"pull run {run + 1}: cold {cold[-1] * 1000:.0f} ms, warm "
                    f"{warm[-1] * 1000:.1f} ms, plain httpx {raw[-1] * 1000:.0f} ms"
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    total = sum(size for _, size in layers)
    cold_median = statistics.median(cold)
    return {
        "layers": LAYERS,
        "compressed_mib": round(total / 2**20, 2),
        "runs": PULL_RUNS,
        "cold_ms": summary_ms(cold),
        "cold_mib_per_s": round(total / 2**20 / cold_median, 1),
        "warm_ms": summary_ms(warm),
        "warm_over_cold": round(statistics.median(warm) / cold_median, 4),
        "baseline_plain_httpx_ms": summary_ms(raw),
        "cold_over_baseline": round(cold_median / statistics.median(raw), 2),
    }


# --- 2 and 3: builds and creates, inside the server's namespace ------------------------------


def context_dir(root: Path, marker: str) -> Path:
    """A build context whose `app` directory (3 small files) differs per run."""
    app = root / "app"
    app.mkdir(parents=True)
    (app / "run.txt").write_text(f"{marker}\n")
    (app / "notes.txt").write_text("template benchmark\n" * 200)
    (app / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    (app / "tool.sh").chmod(0o755)
    return root


def three_steps(context: Path, marker: str, last: str) -> Any:
    from e2b import Template

    return (
        Template(file_context_path=str(context))
        .from_template("base")
        .run_cmd(f"echo {marker} > /tmp/step1.txt")
        .copy("app", "/home/user/app")
        .run_cmd(last)
    )


LAST_COLD = "wc -c /home/user/app/*.txt > /tmp/step3.txt"
LAST_CHANGED = LAST_COLD + " && echo changed >> /tmp/step3.txt"


def timed_build(template: Any, name: str) -> dict[str, Any]:
    """Template.build with its phases: from the client's start and the SDK's "Waiting for logs"
    (files uploaded, build requested) and the server's log lines, to the SDK's return."""
    from e2b import Template

    entries: list[tuple[float, str]] = []
    requested: list[float] = []

    def on_log(entry: Any) -> None:
        if entry.message == "Waiting for logs...":
            requested.append(time.time())
        elif entry.timestamp.tzinfo is not None:  # the server's lines; the SDK's are naive
            entries.append((entry.timestamp.timestamp(), entry.message))

    start = time.time()
    info = Template.build(template, alias=name, on_build_logs=on_log)
    end = time.time()
    messages = [m for _, m in entries]
    cached = sum(1 for m in messages if "] CACHED " in m)
    vm = next(t for t, m in entries if m.startswith("Starting the build VM"))
    steps = [(t, m) for t, m in entries if m.startswith("[") and "] CACHED " not in m]
    ready = next(t for t, m in entries if m.startswith("Template ") and " ready (" in m)
    marks = [(requested[0], "to_build_vm_start"), (vm, "build_vm_start")]
    marks += [(t, f"step_{m[1]}") for t, m in steps]
    marks += [(ready, "sdk_sees_ready")]
    phases = {"upload_and_request": requested[0] - start}
    for (t, label), (t_next, _) in zip(marks, [*marks[1:], (end, "")], strict=True):
        phases[label] = max(0.0, t_next - t)
    # The last step's interval also holds the final save of the template and the VM's kill.
    last = steps[-1][1][1]
    phases[f"step_{last}_and_final_save"] = phases.pop(f"step_{last}")
    return {
        "total": end - start,
        "phases": phases,
        "cached_steps": cached,
        "template_id": info.template_id,
    }


def timed_create(template: str) -> tuple[float, float, Any]:
    from e2b import Sandbox

    start = time.perf_counter()
    sandbox = Sandbox.create(template, timeout=300)
    created = time.perf_counter() - start
    start = time.perf_counter()
    sandbox.commands.run("true")
    return created, time.perf_counter() - start, sandbox


def saved_state(home: Path, template_id: str) -> dict[str, Any]:
    """What a template's current build holds: the state file's size, whether its RAM is a
    memory file (mapped by restores) or inside the state stream, and its size on disk."""
    from aenv.runtime.driver import Snapshot

    template = json.loads((Paths(home).templates / template_id / "template.json").read_text())
    snapshot = Snapshot.load_manifest(Path(template["snapshot_dir"]))
    return {
        "state_mib": round(snapshot.state_file.stat().st_blocks * 512 / 2**20, 2),
        "memory_file": snapshot.memory_file is not None,
        "disk_mib": dir_size(Path(template["snapshot_dir"]))["allocated_mib"],
    }


def creates(name: str, marker: str, changed: bool) -> dict[str, list[float]]:
    """CREATES creates from `base` and from `name`, interleaved, with their first command."""
    samples: dict[str, list[float]] = {"base": [], "built": [], "base_cmd": [], "built_cmd": []}
    for i in range(CREATES):
        for kind, template in (("base", "base"), ("built", name)):
            created, first, sandbox = timed_create(template)
            samples[kind].append(created)
            samples[f"{kind}_cmd"].append(first)
            if kind == "built" and i == 0:
                out = sandbox.commands.run("cat /tmp/step1.txt /tmp/step3.txt").stdout
                assert marker in out and ("changed" in out) == changed, out
            sandbox.kill()
    return samples


def one_run(home: Path, run: int) -> dict[str, Any]:
    name = f"bench-tpl-{secrets.token_hex(3)}"
    marker = f"run-{run}-{secrets.token_hex(4)}"
    context = context_dir(Path(tempfile.mkdtemp(prefix="aenv-bt-ctx-")), marker)
    cold = timed_build(three_steps(context, marker, LAST_COLD), name)
    assert cold["cached_steps"] == 0, cold
    cold["saved"] = saved_state(home, cold["template_id"])
    cold["creates"] = creates(name, marker, False)
    rebuild = timed_build(three_steps(context, marker, LAST_CHANGED), name)
    assert rebuild["cached_steps"] == 2, rebuild
    rebuild["saved"] = saved_state(home, rebuild["template_id"])
    rebuild["creates"] = creates(name, marker, True)
    shutil.rmtree(context)
    ms = {
        k: statistics.median(b["creates"][kind]) * 1000
        for k, b, kind in (
            ("base", cold, "base"),
            ("cold", cold, "built"),
            ("re", rebuild, "built"),
        )
    }
    log(
        f"run {run}: build cold {cold['total']:.2f} s, rebuild {rebuild['total']:.2f} s; "
        f"create from base {ms['base']:.0f} ms, from the cold build {ms['cold']:.0f} ms, "
        f"from the rebuild {ms['re']:.0f} ms"
    )
    return {"cold": cold, "rebuild": rebuild}


def phase_summary(builds: list[dict[str, Any]]) -> dict[str, float]:
    """Median of each phase over the runs, in ms."""
    labels = builds[0]["phases"].keys()
    return {k: round(statistics.median(b["phases"][k] for b in builds) * 1000) for k in labels}


def client() -> None:
    """Runs inside the server's namespace."""
    from importlib.metadata import version

    from e2b import Sandbox

    client_env()
    home = Path(os.environ["AENV_HOME"])
    warm = Sandbox.create(timeout=120)  # the first create after start warms caches
    warm.commands.run("true")
    warm.kill()
    log(f"server up; {RUNS} build runs, {CREATES} creates of each kind per run...")
    runs = [one_run(home, i + 1) for i in range(RUNS)]
    cold = [r["cold"]["total"] for r in runs]
    rebuild = [r["rebuild"]["total"] for r in runs]

    def pooled(build: str, key: str) -> list[float]:
        return [c for r in runs for c in r[build]["creates"][key]]

    base = pooled("cold", "base") + pooled("rebuild", "base")
    result: dict[str, Any] = {
        "sdk": f"e2b {version('e2b')}",
        "runs": RUNS,
        "build_cold_ms": summary_ms(cold),
        "build_cold_phases_median_ms": phase_summary([r["cold"] for r in runs]),
        "rebuild_last_step_changed_ms": summary_ms(rebuild),
        "rebuild_phases_median_ms": phase_summary([r["rebuild"] for r in runs]),
        "rebuild_over_cold": round(statistics.median(rebuild) / statistics.median(cold), 3),
        "saved_cold_build": runs[0]["cold"]["saved"],
        "saved_rebuild": runs[0]["rebuild"]["saved"],
        "creates_per_kind_per_run": CREATES,
        "create_from_base_ms": summary_ms(base),
        "first_command_base_ms": summary_ms(
            pooled("cold", "base_cmd") + pooled("rebuild", "base_cmd")
        ),
    }
    for build in ("cold", "rebuild"):
        built = pooled(build, "built")
        result[f"create_from_{build}_build_ms"] = summary_ms(built)
        result[f"create_from_{build}_build_over_base"] = round(
            statistics.median(built) / statistics.median(base), 3
        )
        result[f"first_command_{build}_build_ms"] = summary_ms(pooled(build, "built_cmd"))
    print(json.dumps(result))


def main() -> None:
    pulls = bench_pull()
    log(f"pull: cold {pulls['cold_ms']['median']:.0f} ms, warm {pulls['warm_ms']['median']} ms")
    with bench_server() as server:
        result = run_client(server, [sys.executable, __file__, "--client"], timeout=3600)
        machine = describe(server)
    report("templates", **machine, pull=pulls, **result)


if __name__ == "__main__":
    entry(main, client)
