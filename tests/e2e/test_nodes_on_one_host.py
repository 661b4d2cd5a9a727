"""Two `aenv server`s on one host, as docs/cluster.md invites: in one network namespace, with only
their homes and ports differing. Each derives a slot prefix, slot network and jail uid range of
its own (aenv/claims.py), both serve a sandbox at once, and the second's start touches nothing
of the first's; a third that asks for the first's prefix is refused. A graceful stop leaves on
tmpfs only the saved templates' memory, which the restart restores from. One sandbox a node."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from aenv.claims import derive
from aenv.config import Paths, load
from aenv.orchestrator.images import prepare_images
from aenv.orchestrator.templates import TemplateStore
from aenv.runtime.sweep import reap_strays
from tests.e2e.server_ns import ServerNs, server_in_namespace
from tests.server.test_node_start import exit_code, namespaces
from tests.support.guest import GUEST_CACHE, MIRROR

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

# Run in the nodes' namespace. WAIT: until the node on a port serves. CALL: one request (to a
# sandbox's envd when one is given); prints the status and body as JSON.
WAIT = """
import httpx, sys, time
while True:
    try:
        if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=5).is_success:
            break
    except httpx.TransportError:
        pass
    time.sleep(0.5)
"""
CALL = """
import httpx, json, sys
port, method, path, body, key, sandbox, token = sys.argv[1:8]
headers = {"X-API-Key": key}
if sandbox:
    headers |= {"E2b-Sandbox-Id": sandbox, "E2b-Sandbox-Port": "49983", "X-Access-Token": token}
r = httpx.request(method, f"http://127.0.0.1:{port}{path}", headers=headers,
                  json=json.loads(body) if body else None, timeout=600)
print(json.dumps({"status": r.status_code, "body": r.text}))
"""


def serving(node: ServerNs) -> None:
    """Wait until the node serves (its first start builds its template)."""
    code, out = node.run(sys.executable, "-c", WAIT, str(node.port), timeout=1800)
    assert code == 0, node.failure("waiting for the node", out)


@dataclass(frozen=True)
class Sandbox:
    sandbox_id: str
    envd_token: str


def call(
    node: ServerNs, method: str, path: str, body: str = "", sandbox: Sandbox | None = None
) -> tuple[int, str]:
    key = Paths(node.home).api_key.read_text().strip()
    to = ("", "") if sandbox is None else (sandbox.sandbox_id, sandbox.envd_token)
    argv = (sys.executable, "-c", CALL, str(node.port), method, path, body, key, *to)
    code, out = node.run(*argv, timeout=600)
    assert code == 0, node.failure(f"{method} {path}", out)
    answer = json.loads(out.strip().splitlines()[-1])
    return answer["status"], answer["body"]


def create(node: ServerNs) -> Sandbox:
    serving(node)
    status, body = call(node, "POST", "/sandboxes", '{"templateID": "base", "timeout": 3600}')
    assert status == 201, node.failure("create", body)
    created = json.loads(body)
    return Sandbox(created["sandboxID"], created.get("envdAccessToken") or "")


def reachable(node: ServerNs, sandbox: Sandbox) -> bool:
    """Whether the node's proxy reaches this sandbox's own envd through its slot (guests have
    one address in every slot: a slot of the other node's at the same host address would lead
    to the other node's guest)."""
    status, body = call(node, "GET", "/envs", sandbox=sandbox)
    return status == 200 and json.loads(body).get("E2B_SANDBOX_ID") == sandbox.sandbox_id


def slot_namespaces(prefix: str) -> dict[str, int]:
    """The slot namespaces named `<prefix>-<n>`, by the identity of the namespace each names
    (one swept and made again under its name is another)."""
    return {name: os.stat(f"/run/netns/{name}").st_ino for name in namespaces(prefix)}


def left_on_tmpfs(home: Path) -> set[Path]:
    """The files under the node's tmpfs directory that no saved template of it names."""
    memory = Paths(home).memory
    store = TemplateStore(Paths(home).templates, memory)
    store.load()
    kept = {memory / template.template_id for template in store.list_all()}
    return {
        path
        for path in memory.rglob("*")
        if path.is_file() and not any(path.is_relative_to(k) for k in kept)
    }


def test_two_nodes_on_one_host_share_nothing() -> None:
    # Short paths: VMM control sockets live under the data dir and AF_UNIX caps paths at 107.
    scratch = Path(tempfile.mkdtemp(prefix="aenv-two-"))
    homes = scratch / "a", scratch / "b"
    # As an operator starts them: no slot prefix or network set (the harness sets them).
    unset = {"AENV_NETWORK_PREFIX": "", "AENV_NETWORK_CIDR": ""}
    prefixes = [derive(load(env={"AENV_HOME": str(h)}), [], "").network_prefix for h in homes]
    try:
        for home in homes:  # from here: the nodes' namespace has no route to the mirrors
            asyncio.run(prepare_images(Paths(home).cache, GUEST_CACHE, MIRROR))
        with server_in_namespace(homes[0], port=3000, settings=unset) as first:
            second = ServerNs(
                first.netns, homes[1], 3001, homes[1] / "server.log",
                {**first.env, "AENV_HOME": str(homes[1])},
            )  # fmt: skip
            try:
                on_first = create(first)
                assert reachable(first, on_first)
                slots_of_first = slot_namespaces(prefixes[0])
                second.start()
                on_second = create(second)
                assert reachable(second, on_second)
                assert reachable(first, on_first), first.failure("the first's sandbox", "")
                assert slots_of_first.items() <= slot_namespaces(prefixes[0]).items()
                assert set(namespaces(prefixes[1])) and prefixes[0] != prefixes[1]

                third = ServerNs(
                    first.netns, scratch / "c", 3002, scratch / "c.log",
                    {**first.env, "AENV_HOME": str(scratch / "c"),
                     "AENV_NETWORK_PREFIX": prefixes[0]},
                )  # fmt: skip
                third.start()
                assert exit_code(third) == 2
                refusal = third.log.read_text()
                assert f"network_prefix '{prefixes[0]}' is held by the node of" in refusal
                assert reachable(first, on_first)

                second.stop()  # graceful: pauses its sandbox
                assert second.proc is not None and second.proc.returncode == 0
                assert left_on_tmpfs(homes[1]) == set()
                assert namespaces(prefixes[1]) == []
                assert reachable(first, on_first)
            finally:
                second.stop()
    finally:
        for prefix in prefixes:  # what a node that failed left
            for name in namespaces(prefix):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
        for home in homes:
            reap_strays(home)
            shutil.rmtree(Paths(home).memory, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
