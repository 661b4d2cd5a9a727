"""Code interpreter benchmark: `run_code("1+1")` vs `commands.run("true")`, p50/p99 and ratio,
both through the official SDKs and measured in the same run.

Default: our server (`python -m aenv.code_interpreter`) and envd as local processes (envd in
the tests' throwaway root), so the figures are the servers' own costs without a VM. With
`--node`, both run in one `code-interpreter-v1` sandbox of the node the SDK's environment
names (`E2B_API_URL`/`E2B_DOMAIN`, `E2B_API_KEY`). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from summary import summary_ms

from tests.support.envd_process import envd_in_throwaway_root
from tests.support.ports import free_port

RUNS = 200
WARM_UP = 5


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
def local_code_interpreter() -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="aenv-bench-ci-") as cwd:
        args = ["--host", "127.0.0.1", "--port", str(port), "--cwd", cwd]
        process = subprocess.Popen([sys.executable, "-m", "aenv.code_interpreter", *args])
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


def bench_local() -> dict[str, object]:
    from e2b import Sandbox as EnvdSandbox
    from e2b_code_interpreter import Sandbox

    with local_code_interpreter() as ci_url, envd_in_throwaway_root(free_port()) as envd_url:
        interpreter = Sandbox.create(debug=True, sandbox_url=ci_url)
        envd = EnvdSandbox.create(debug=True, sandbox_url=envd_url)
        assert interpreter.run_code("1+1").text == "2"
        result = compare(lambda: interpreter.run_code("1+1"), lambda: envd.commands.run("true"))
    return {"where": "local processes", **result}


def bench_node() -> dict[str, object]:
    from e2b_code_interpreter import Sandbox

    start = time.perf_counter()
    sandbox = Sandbox.create(timeout=600)
    try:
        first = sandbox.run_code("1+1")
        create_to_first_result = time.perf_counter() - start
        assert first.text == "2"
        result = compare(lambda: sandbox.run_code("1+1"), lambda: sandbox.commands.run("true"))
    finally:
        sandbox.kill()
    return {
        "where": "one code-interpreter-v1 sandbox",
        "create_to_first_result_ms": round(create_to_first_result * 1000, 1),
        **result,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--node", action="store_true", help="against the SDK's node")
    args = parser.parse_args()
    print(json.dumps(bench_node() if args.node else bench_local(), indent=2))


if __name__ == "__main__":
    main()
