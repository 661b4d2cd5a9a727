"""Code interpreter benchmark: `run_code("1+1")` vs `commands.run("true")`, p50/p99 and ratio,
both through the official SDKs and measured in the same run.

Default: our server (`python -m aenv.code_interpreter`) and envd as local processes (envd in
the tests' throwaway root), so the figures are the servers' own costs without a VM; and
`create_code_context()` taking the server's spare kernel vs starting one (`--no-spare`). With
`--node`, both run in one `code-interpreter-v1` sandbox of the node the SDK's environment
names (`E2B_API_URL`/`E2B_DOMAIN`, `E2B_API_KEY`), and the node is measured too:
`Sandbox.create()` to the first `run_code` result (p50), and `--forks` children of a sandbox
holding a loaded dataframe, forked vs created afresh and loading it again (totals, per child,
ratio). `--first-cells`: each language's first cell in a new sandbox against its later ones,
plain and reading env vars (an execution's; on a node, the sandbox's too). Prints one JSON
document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from server_ns import metric, wait_until
from summary import summary_ms

from tests.support.envd_process import envd_in_throwaway_root
from tests.support.kernelspecs import kernelspecs
from tests.support.ports import free_port

RUNS = 200
WARM_UP = 5
CONTEXT_RUNS = 5
# A kernel starts in a second or two natively: by then the spare taken last is replaced.
CONTEXT_SPACING_S = 10.0
# The dataframe forks carry and fresh sandboxes load again.
ROWS, COLUMNS = 200_000, 10
LOAD = (
    "import numpy as np, pandas as pd\n"
    f"df = pd.DataFrame(np.random.default_rng(0).random(({ROWS}, {COLUMNS})))"
)


def timed(fn: Callable[[], object], runs: int = RUNS) -> list[float]:
    for _ in range(WARM_UP):
        fn()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


@contextmanager
def local_code_interpreter(*extra: str) -> Iterator[str]:
    """Our server with every language's kernel this host has; no envd (another one may be on
    envd's port)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="aenv-bench-ci-") as cwd:
        args = ["--host", "127.0.0.1", "--port", str(port), "--cwd", cwd, "--envd-url", ""]
        env = {**os.environ, "JUPYTER_PATH": str(kernelspecs(Path(cwd) / ".jupyter"))}
        command = [sys.executable, "-m", "aenv.code_interpreter", *args, *extra]
        process = subprocess.Popen(command, env=env)
        try:
            while True:
                try:
                    if httpx.get(f"{url}/health").is_success:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)


def compare(run_code: Callable[[], object], run_true: Callable[[], object]) -> dict[str, object]:
    code = timed(run_code)
    command = timed(run_true)
    return {
        "run_code_1_plus_1_ms": summary_ms(code),
        "commands_run_true_ms": summary_ms(command),
        "ratio_p50": round(statistics.median(code) / statistics.median(command), 3),
    }


def contexts(url: str) -> list[float]:
    """Seconds per `create_code_context()`, each once the last one's spare refill is ready."""
    from e2b_code_interpreter import Sandbox

    sandbox = Sandbox.create(debug=True, sandbox_url=url)
    samples = []
    for _ in range(CONTEXT_RUNS):
        time.sleep(CONTEXT_SPACING_S)
        start = time.perf_counter()
        context = sandbox.create_code_context()
        samples.append(time.perf_counter() - start)
        sandbox.remove_code_context(context)
    return samples


def bench_contexts() -> dict[str, object]:
    with local_code_interpreter() as url:
        spare = contexts(url)
    with local_code_interpreter("--no-spare") as url:
        started = contexts(url)
    return {
        "spare_ms": summary_ms(spare),
        "no_spare_ms": summary_ms(started),
        "ratio_p50": round(statistics.median(spare) / statistics.median(started), 3),
    }


def bench_local() -> dict[str, object]:
    from e2b import Sandbox as EnvdSandbox
    from e2b_code_interpreter import Sandbox

    with local_code_interpreter() as ci_url, envd_in_throwaway_root(free_port()) as envd_url:
        interpreter = Sandbox.create(debug=True, sandbox_url=ci_url)
        envd = EnvdSandbox.create(debug=True, sandbox_url=envd_url)
        assert interpreter.run_code("1+1").text == "2"
        result = compare(lambda: interpreter.run_code("1+1"), lambda: envd.commands.run("true"))
    return {"where": "local processes", **result, "create_code_context": bench_contexts()}


def create_to_first_result(runs: int, pooled: bool) -> list[float]:
    """Seconds from `Sandbox.create()` to the first `run_code` result, per sandbox; with
    `pooled`, each create waits until the node's warm pool holds a VM (a create spaced from
    the last, as a refill needs: back-to-back creates all miss by design)."""
    from e2b_code_interpreter import Sandbox

    samples = []
    for run in range(runs + pooled):
        # A pool is sized to the template's recent creates: the first, untimed, asks for it.
        if pooled and run > 0:
            wait_until(lambda: metric("aenv_pool_vms", os.environ["E2B_API_URL"]) >= 1, 300)
        start = time.perf_counter()
        sandbox = Sandbox.create(timeout=600)
        try:
            assert sandbox.run_code("1+1").text == "2"
            if not (pooled and run == 0):
                samples.append(time.perf_counter() - start)
        finally:
            sandbox.kill()
    return samples


def fork_vs_create(count: int) -> dict[str, object]:
    """`count` sandboxes holding a loaded dataframe: forked from one that loaded it, vs
    created afresh, each loading it again (both ready once each child answers `len(df)`)."""
    from e2b_code_interpreter import Sandbox

    def ready(sandbox: Sandbox) -> Sandbox:
        assert sandbox.run_code("len(df)", timeout=600).text == str(ROWS)
        return sandbox

    def loaded() -> Sandbox:
        sandbox = Sandbox.create(timeout=900)
        assert sandbox.run_code(LOAD, timeout=600).error is None
        return sandbox

    parent = loaded()
    children: list[Sandbox] = []
    try:
        start = time.perf_counter()
        forks = parent.fork(count=count, timeout=900)
        children = [c for c in forks if isinstance(c, Sandbox)]
        assert len(children) == count, forks
        with ThreadPoolExecutor(count) as pool:
            list(pool.map(ready, children))
        forked = time.perf_counter() - start
    finally:
        for sandbox in [parent, *children]:
            sandbox.kill()
    created: list[Sandbox] = []
    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(count) as pool:
            created = list(pool.map(lambda _: ready(loaded()), range(count)))
        fresh = time.perf_counter() - start
    finally:
        for sandbox in created:
            sandbox.kill()
    return {
        "count": count,
        "dataframe": f"{ROWS} x {COLUMNS} floats",
        "fork_total_s": round(forked, 2),
        "fork_per_child_s": round(forked / count, 2),
        "create_and_reload_total_s": round(fresh, 2),
        "create_and_reload_per_child_s": round(fresh / count, 2),
        "fork_vs_create_ratio": round(forked / fresh, 3),
    }


def bench_node(create_runs: int, forks: int, pooled: bool) -> dict[str, object]:
    from e2b_code_interpreter import Sandbox

    firsts = create_to_first_result(create_runs, pooled)
    sandbox = Sandbox.create(timeout=600)
    try:
        result = compare(lambda: sandbox.run_code("1+1"), lambda: sandbox.commands.run("true"))
    finally:
        sandbox.kill()
    return {
        "where": "code-interpreter-v1 sandboxes",
        "create_to_first_result_ms": summary_ms(firsts),
        "warm_pool": pooled,
        **result,
        **({"fork_vs_create": fork_vs_create(forks)} if forks else {}),
    }


# A cell per language whose answer is 2.
FIRST_CELLS = {
    "python": "1 + 1",
    "javascript": "1 + 1",
    "typescript": "1 + 1",
    "r": "1 + 1",
    "java": "1 + 1",
    "bash": "echo 2",
}
# A cell per language that shows BENCH_ENV (Java's env vars are system properties, as E2B's).
READ_ENV = {
    "python": "import os; os.getenv('BENCH_ENV')",
    "javascript": "process.env.BENCH_ENV",
    "typescript": "process.env.BENCH_ENV",
    "r": 'Sys.getenv("BENCH_ENV")',
    "java": 'System.getProperty("BENCH_ENV")',
    "bash": "echo $BENCH_ENV",
}
LATER_RUNS = 5
# Longer than any first cell should take, short enough that a hung one fails the run.
CELL_TIMEOUT_S = 300


def _shown(execution: object) -> str:
    """What a cell gave: its result's text (R's is a display), else its stdout; R shows a
    character vector as `[1] "x"`."""
    from e2b_code_interpreter import Execution

    assert isinstance(execution, Execution)
    assert execution.error is None, execution.error
    texts = [r.text for r in execution.results if r.text is not None]
    text = (texts[0] if texts else "".join(execution.logs.stdout)).strip()
    return text.removeprefix("[1] ").strip('"')


def first_cells(
    sandbox: object, cells: dict[str, str], expected: str, envs: dict[str, str] | None = None
) -> dict[str, object]:
    """Per language: seconds of its first cell in `sandbox`, the median of the next ones, and
    their ratio; each cell run with the execution's `envs` and showing `expected`."""
    from e2b_code_interpreter import Sandbox

    assert isinstance(sandbox, Sandbox)
    out: dict[str, object] = {}
    for language, code in cells.items():
        samples = []
        for _ in range(1 + LATER_RUNS):
            start = time.perf_counter()
            execution = sandbox.run_code(code, language=language, envs=envs, timeout=CELL_TIMEOUT_S)
            samples.append(time.perf_counter() - start)
            assert _shown(execution) == expected, (language, execution)
        later = statistics.median(samples[1:])
        out[language] = {
            "first_ms": round(samples[0] * 1000, 1),
            "later_p50_ms": round(later * 1000, 1),
            "ratio": round(samples[0] / later, 2),
        }
    return out


def bench_first_cells(node: bool) -> dict[str, object]:
    """Each language's first and later cells in a new sandbox: plain ones, ones that read an
    env var of the execution's (`run_code(envs=)`), and, on a node, ones that read the
    sandbox's (`Sandbox.create(envs=)`), each kind in a sandbox of its own."""
    from e2b_code_interpreter import Sandbox

    execution_envs = {"BENCH_ENV": "execution"}
    result: dict[str, object] = {}
    if node:
        result["where"] = "code-interpreter-v1 sandboxes"
        kinds = (
            ("plain", None, FIRST_CELLS, "2", None),
            ("sandbox_envs", {"BENCH_ENV": "sandbox"}, READ_ENV, "sandbox", None),
            ("execution_envs", None, READ_ENV, "execution", execution_envs),
        )
        for name, sandbox_envs, cells, expected, envs in kinds:
            sandbox = Sandbox.create(timeout=1200, envs=sandbox_envs)
            try:
                result[name] = first_cells(sandbox, cells, expected, envs)
            finally:
                sandbox.kill()
        return result
    result["where"] = "local processes"
    for name, warm in (("warm", ",".join(FIRST_CELLS)), ("python_only", "python")):
        with local_code_interpreter("--default-contexts", warm) as url:
            sandbox = Sandbox.create(debug=True, sandbox_url=url)
            result[name] = first_cells(sandbox, FIRST_CELLS, "2")
        with local_code_interpreter("--default-contexts", warm) as url:
            sandbox = Sandbox.create(debug=True, sandbox_url=url)
            reads = first_cells(sandbox, READ_ENV, "execution", execution_envs)
            result[f"{name}_execution_envs"] = reads
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--node", action="store_true", help="against the SDK's node")
    parser.add_argument("--create-runs", type=int, default=5, help="--node: creates timed")
    parser.add_argument("--forks", type=int, default=16, help="--node: fork children, 0: none")
    parser.add_argument("--pooled", action="store_true", help="--node: creates on pool hits")
    parser.add_argument("--first-cells", action="store_true", help="each language's first cell")
    args = parser.parse_args()
    if args.first_cells:
        result = bench_first_cells(args.node)
    elif args.node:
        result = bench_node(args.create_runs, args.forks, args.pooled)
    else:
        result = bench_local()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
