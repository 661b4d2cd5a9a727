"""The npm `e2b` SDK's network options (installed beforehand by test_network.py: this namespace
has no route to the npm registry): egress rules at create, in the info and by updateNetwork, an
egress proxy, HTTPS ports, and private traffic with its token, against the server reached by
its domain over HTTPS."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.e2e.internet import PUBLIC, SOCKS_IP
from tests.support.js import JS_DIR
from tests.support.socks_server import PASSWORD, PORT, USER

A, B = PUBLIC


def test_npm_sdk_network_options() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is needed for the npm e2b SDK")
    assert (JS_DIR / "node_modules" / "e2b").exists(), "test_network.py installs the npm SDK"
    env = {**os.environ, "NODE_EXTRA_CA_CERTS": os.environ["SSL_CERT_FILE"]}
    result = subprocess.run(
        [node, "server_network.mjs", A, B, f"{SOCKS_IP}:{PORT}", USER, PASSWORD],
        cwd=JS_DIR,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "created": [A],
        "info": {"allowOut": [A], "denyOut": ["0.0.0.0/0"]},
        "updated": [B],
        "cleared": [A, B],
        "proxied": [A],
        "proxyInfo": {"address": f"{SOCKS_IP}:{PORT}", "username": USER},
        "refused": [],
        "token": True,
        "without": 403,
        "with": 502,
        "httpsPorts": [8443],
    }
