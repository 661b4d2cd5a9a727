"""`sandbox.get_host(port)` with the environment `aenv auth` prints for a node without a domain:
a `*.localhost` name that curl (like browsers and systemd's resolver) maps to loopback with no
DNS set-up, which the node routes to the sandbox's port. Without it the SDK names E2B's cloud."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from e2b import ConnectionConfig, Sandbox
from packaging.version import Version
from typer.testing import CliRunner

from aenv.cli.main import app
from aenv.config import Paths
from aenv.envd import ENVD_VERSION
from aenv.proxy import SandboxProxy
from tests.proxy.conftest import USER_PORT
from tests.proxy.support import WAIT, DictResolver, serve
from tests.support.ports import free_port

KEY = "e2b_" + "7" * 40


def _auth_environment(home: Path, port: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    Paths(home).api_key.parent.mkdir(parents=True, exist_ok=True)
    Paths(home).api_key.write_text(KEY + "\n")
    for name in ("AENV_DOMAIN", "AENV_TLS_CERT", "AENV_TLS_KEY", "AENV_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AENV_PORT", str(port))
    result = CliRunner().invoke(app, ["auth", "--home", str(home)])
    assert result.exit_code == 0, result.output
    pairs = [line.removeprefix("export ").split("=", 1) for line in result.output.splitlines()]
    return {name: value for name, value in pairs}


def test_get_host_reaches_the_sandbox_port_through_localhost_names(
    tmp_path: Path,
    resolver: DictResolver,
    sandbox_id: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    curl = shutil.which("curl")
    assert curl is not None
    port = free_port()
    env = _auth_environment(tmp_path, port, monkeypatch)
    assert env["E2B_DOMAIN"] == f"localhost:{port}"
    assert env["E2B_VOLUME_API_URL"] == env["E2B_API_URL"] == f"http://localhost:{port}"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    # As after a create: the node answers no domain of its own, so the SDK takes E2B_DOMAIN.
    sandbox = Sandbox(
        sandbox_id=sandbox_id,
        sandbox_domain=None,
        envd_version=Version(ENVD_VERSION),
        envd_access_token=None,
        traffic_access_token=None,
        connection_config=ConnectionConfig(),
    )
    host = sandbox.get_host(USER_PORT)
    assert host == f"{USER_PORT}-{sandbox_id}.localhost:{port}"
    with serve(SandboxProxy(resolver, domain=None), port):
        out = subprocess.run(
            [curl, "-sS", "--noproxy", "*", f"http://{host}/through/localhost"],
            capture_output=True,
            text=True,
            timeout=WAIT,
        )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)  # the upstream's echo: the request reached the sandbox port
    assert seen["path"] == "/through/localhost"
