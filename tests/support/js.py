"""The npm `e2b` SDK for tests: installed once into tests/js/node_modules (gitignored) exactly as
tests/js/package-lock.json pins it; None when node or npm are missing."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

JS_DIR = Path(__file__).resolve().parents[1] / "js"
E2B_VERSION = "2.51.0"


def ensure_npm_sdk() -> Path | None:
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        return None
    installed = JS_DIR / "node_modules" / "e2b" / "package.json"
    if not installed.exists() or json.loads(installed.read_text())["version"] != E2B_VERSION:
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=JS_DIR,
            check=True,
            timeout=600,
        )
    return JS_DIR / "node_modules"
