"""The npm `e2b` SDK through the proxy (undici over HTTP/1.1, chunked request bodies): commands,
streamed output, a 3 MiB file both ways, a streamed directory watch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from e2b import Sandbox

from aenv.envd import ENVD_VERSION
from tests.proxy.conftest import ENVD_SANDBOX
from tests.support.js import ensure_npm_sdk

SCRIPT = Path(__file__).with_name("js_smoke.mjs")


def test_js_sdk_through_the_proxy(proxy_url: str, sandbox: Sandbox) -> None:
    node, modules = shutil.which("node"), ensure_npm_sdk()
    if node is None or modules is None:
        pytest.skip("node and npm are needed for the npm e2b SDK test")
    sdk_module = modules / "e2b" / "dist" / "index.mjs"
    smoke_dir = f"/tmp/js-proxy-{uuid.uuid4().hex[:8]}"
    sandbox.files.make_dir(smoke_dir)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("E2B_")},
        "E2B_MODULE": str(sdk_module),
        "PROXY_URL": proxy_url,
        "SANDBOX_ID": ENVD_SANDBOX,
        "ENVD_VERSION": ENVD_VERSION,
        "SMOKE_DIR": smoke_dir,
    }
    try:
        result = subprocess.run(
            [node, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        sandbox.files.remove(smoke_dir)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "run": {"stdout": "hello\n", "stderr": "err\n", "exitCode": 0},
        "streamed": "1\n2\n3\n",
        "bigReadBack": True,
        "watched": True,
        "running": True,
    }
