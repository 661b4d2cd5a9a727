"""The npm `e2b` and `@e2b/code-interpreter` SDKs and the E2B CLI for tests: each installed
once into its node_modules (gitignored) exactly as its package-lock.json pins it (tests/js,
tests/js/cli); None when node or npm are missing."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

JS_DIR = Path(__file__).resolve().parents[1] / "js"
E2B_VERSION = "2.51.0"
# As src/aenv/code_interpreter/template.yaml installs it.
TSLAB_VERSION = "1.0.22"
CLI_DIR = JS_DIR / "cli"


def ensure_npm_sdk() -> Path | None:
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        return None
    installed = JS_DIR / "node_modules" / "e2b" / "package.json"
    interpreter = JS_DIR / "node_modules" / "@e2b" / "code-interpreter" / "package.json"
    if (
        not installed.exists()
        or json.loads(installed.read_text())["version"] != E2B_VERSION
        or not interpreter.exists()
    ):
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=JS_DIR,
            check=True,
            timeout=600,
        )
    return JS_DIR / "node_modules"


def ensure_npm_cli() -> Path | None:
    """The E2B CLI (`@e2b/cli`) as tests/js/cli/package-lock.json pins it: its executable, or
    None when node or npm are missing."""
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        return None
    executable = CLI_DIR / "node_modules" / ".bin" / "e2b"
    if not executable.exists():
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=CLI_DIR,
            check=True,
            timeout=600,
        )
    return executable


def ensure_tslab() -> Path | None:
    """tslab, the JavaScript and TypeScript Jupyter kernels, installed as the code interpreter
    template installs it (`npm install -g`, its own dependencies nested under it, where it
    finds the Node.js types) into build/tslab: its executable, or None without node and npm."""
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        return None
    prefix = JS_DIR.parents[1] / "build" / "tslab"
    executable = prefix / "bin" / "tslab"
    package = prefix / "lib" / "node_modules" / "tslab" / "package.json"
    if not package.exists() or json.loads(package.read_text())["version"] != TSLAB_VERSION:
        subprocess.run(
            [npm, "install", "--global", "--prefix", str(prefix), f"tslab@{TSLAB_VERSION}",
             "--no-audit", "--no-fund", "--loglevel=error"],
            check=True,
            timeout=600,
        )  # fmt: skip
    return executable


def run_node_script(script: str, timeout: float) -> object:
    """Runs `script` of tests/js with node and returns the JSON of its last output line; skips
    the calling test when node is not installed."""
    import pytest

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is needed for the npm e2b SDK")
    assert (JS_DIR / "node_modules" / "e2b").exists(), "test_server.py installs the npm SDK"
    result = subprocess.run(
        [node, script], cwd=JS_DIR, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])
