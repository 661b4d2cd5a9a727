"""E2B's own code-interpreter tests (e2b-dev/code-interpreter: `python/tests`, sync, async,
charts and images, and `js/tests`) run unmodified against a node, with the SDKs from the
registries: the Python suites with this environment's `e2b-code-interpreter`, the JS suite
with the npm `@e2b/code-interpreter` that tests/js pins (its imports of the repository's own
`src` point at that package instead; nothing else changes). Their outcomes, per test, are
printed as one JSON document; docs/compatibility.md explains the failures.

    eval "$(.venv/bin/aenv auth --home /var/lib/aenv)"
    .venv/bin/python -m tests.support.e2b_ci_suites <checkout> [--python] [--js]

`<checkout>`: a clone of e2b-dev/code-interpreter (a bare one too); its HEAD is read, never
copied into this repository. The SDK finds the node through `E2B_API_URL`, `E2B_DOMAIN`,
`E2B_SANDBOX_URL` and `E2B_API_KEY`, as `aenv auth` prints them.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.support.js import JS_DIR

# Per test: the node builds nothing here, but a sandbox of six warm kernels resumes under TCG.
PYTHON_TIMEOUT_S = 600
SUITE_TIMEOUT_S = 3 * 3600
# The JS suite's runner, as the suite's own package.json asks for it.
JS_RUNNER = {"vitest": "^4.1.0", "dotenv": "^16.4.5"}
_SRC_IMPORT = re.compile(r"""(from\s+|import\s*\(\s*)(['"])(?:\.\./)+src\2""")
NEEDED = ("E2B_API_KEY", "E2B_API_URL", "E2B_DOMAIN")


# The suites and their runners' settings; not the SDKs' own source beside them, which pytest
# would import (it puts its working directory first on sys.path) in place of the registry's.
SUITE_FILES = ("python/tests", "python/pytest.ini", "js/tests", "js/vitest.config.mts")


def extract(checkout: Path, into: Path) -> Path:
    """The suites of the checkout's HEAD written under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(checkout), "archive", "--format=tar", "HEAD", *SUITE_FILES],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def head(checkout: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def python_suites(root: Path) -> dict[str, object]:
    """pytest over `python/tests` with the suite's own pytest.ini (two xdist workers)."""
    report = root / "python-report.xml"
    command = [
        sys.executable, "-m", "pytest", "tests", "-p", "no:cacheprovider", "-q",
        f"--timeout={PYTHON_TIMEOUT_S}", f"--junitxml={report}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "E2B_DEBUG"}
    # Its progress to stderr: stdout is this command's JSON.
    subprocess.run(
        command, cwd=root / "python", env=env, stdout=sys.stderr, timeout=SUITE_TIMEOUT_S
    )
    return junit(report)


def junit(report: Path) -> dict[str, object]:
    outcomes: dict[str, str] = {}
    failures: dict[str, str] = {}
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            outcomes[name] = "failed"
            failures[name] = first_line(problem.get("message") or problem.text or "")
        elif case.find("skipped") is not None:
            outcomes[name] = "skipped"
        else:
            outcomes[name] = "passed"
    return {**counts(outcomes), "failures": failures}


def js_suite(root: Path) -> dict[str, object]:
    """vitest over `js/tests` with the suite's own config, `@e2b/code-interpreter` from npm."""
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        return {"skipped": "node and npm are needed"}
    js = root / "js"
    pinned = json.loads((JS_DIR / "package.json").read_text())["dependencies"]
    package = {
        "name": "e2b-ci-suite",
        "private": True,
        "type": "module",
        "dependencies": {"@e2b/code-interpreter": pinned["@e2b/code-interpreter"], **JS_RUNNER},
    }
    (js / "package.json").write_text(json.dumps(package, indent=1))
    for test in (js / "tests").rglob("*.ts"):
        test.write_text(_SRC_IMPORT.sub(r"\1\2@e2b/code-interpreter\2", test.read_text()))
    install = [npm, "install", "--no-audit", "--no-fund", "--loglevel=error"]
    subprocess.run(install, cwd=js, stdout=sys.stderr, check=True, timeout=900)
    report = root / "js-report.json"
    vitest = [str(js / "node_modules" / ".bin" / "vitest"), "run", "--reporter=json"]
    vitest.append(f"--outputFile={report}")
    subprocess.run(vitest, cwd=js, stdout=sys.stderr, timeout=SUITE_TIMEOUT_S)
    outcomes: dict[str, str] = {}
    failures: dict[str, str] = {}
    for suite in json.loads(report.read_text())["testResults"]:
        where = Path(suite["name"]).relative_to(js).as_posix()
        for test in suite["assertionResults"]:
            name = f"{where}::{test['fullName']}"
            outcome = {"pending": "skipped", "todo": "skipped"}.get(test["status"], test["status"])
            outcomes[name] = outcome
            if outcome == "failed":
                failures[name] = first_line("\n".join(test["failureMessages"]))
    return {**counts(outcomes), "failures": failures}


def counts(outcomes: dict[str, str]) -> dict[str, int]:
    found = {"tests": len(outcomes)}
    for outcome in ("passed", "failed", "skipped"):
        found[outcome] = sum(1 for o in outcomes.values() if o == outcome)
    return found


def first_line(message: str) -> str:
    """What a failure says first; vitest may put a bare `Error: STACK_TRACE_ERROR` before it."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    said = [line for line in lines if line != "Error: STACK_TRACE_ERROR"] or lines
    return " / ".join(said[:2])[:300]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.e2b_ci_suites")
    parser.add_argument("checkout", type=Path, help="a clone of e2b-dev/code-interpreter")
    parser.add_argument("--python", action="store_true", help="the Python suites only")
    parser.add_argument("--js", action="store_true", help="the JS suite only")
    args = parser.parse_args(argv)
    if missing := [name for name in NEEDED if not os.environ.get(name)]:
        parser.error(f'{", ".join(missing)} not set: eval "$(aenv auth)" first')
    both = not (args.python or args.js)
    result: dict[str, object] = {"commit": head(args.checkout)}
    with tempfile.TemporaryDirectory(prefix="e2b-ci-suites-") as scratch:
        root = extract(args.checkout, Path(scratch))
        if args.python or both:
            result["python"] = python_suites(root)
        if args.js or both:
            result["js"] = js_suite(root)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
