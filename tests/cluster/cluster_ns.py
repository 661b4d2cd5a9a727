"""A cluster on this machine for end-to-end tests and benchmarks: nodes each in a network
namespace of their own (`tests.e2e.server_ns`), and a gateway in another, joined to each node by a
veth pair. Clients run in the gateway's namespace, where the gateway listens on loopback. Redis is
reached over its unix socket, which crosses namespaces. With `shared_repository`, an S3 server
(moto's server mode) runs in the gateway's namespace too, and every node keeps its snapshot
repository in one bucket there, reached over its own link.
"""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import string
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx

from aenv.config import Paths
from tests.e2e.server_ns import PREFIX, ServerNs, in_netns, server_in_namespace
from tests.support.process_group import stop_group

GATEWAY_PORT = 3100
NODE_PORT = 3000
S3_PORT = 3200
BUCKET = "aenv-cluster"
S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class Gateway:
    netns: str
    home: Path
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    port: int = GATEWAY_PORT

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_key(self) -> str:
        return Paths(self.home).api_key.read_text().strip()

    def start(self, settings: Mapping[str, str] = {}) -> subprocess.Popen[bytes]:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                in_netns(self.netns, sys.executable, "-m", "aenv.cli", "gateway",
                         "--port", str(self.port), "--host", "127.0.0.1"),
                env={**self.env, **settings}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        return self.proc

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.run(["curl", "-sf", "-o", "/dev/null", f"{self.url}/health"])[0] != 0:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "the gateway never answered its health check"
            time.sleep(0.3)

    def stop(self) -> None:
        stop_group(self.proc, grace_s=30)

    def kill_9(self) -> None:
        """SIGKILL the gateway, as a crash would end it."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def spawn(
        self, argv: list[str], out: Path, env: Mapping[str, str] = {}
    ) -> subprocess.Popen[bytes]:
        """A client command in the gateway's namespace, left running, its output into `out`;
        the caller ends it (`stop_group`)."""
        with out.open("ab") as log:
            return subprocess.Popen(
                in_netns(self.netns, *argv), env={**self.env, **env}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def run(
        self, argv: list[str], env: Mapping[str, str] = {}, timeout: float = 600
    ) -> tuple[int, str]:
        """A client command in the gateway's namespace: its exit code and output."""
        done = subprocess.run(
            in_netns(self.netns, *argv), env={**self.env, **env}, capture_output=True,
            timeout=timeout, check=False,
        )  # fmt: skip
        return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


@dataclass
class Cluster:
    gateway: Gateway
    nodes: dict[str, ServerNs]
    addresses: dict[str, str]

    def internal(self, node_id: str, path: str, token: str | None) -> httpx.Response:
        """A request to a node's internal API from the gateway's namespace (a client there)."""
        headers = [] if token is None else ["-H", f"X-Aenv-Cluster-Token: {token}"]
        code, out = self.gateway.run(
            ["curl", "-s", "-w", "\n%{http_code}", *headers,
             f"http://{self.addresses[node_id]}{path}"]
        )  # fmt: skip
        assert code == 0, out
        body, status = out.rsplit("\n", 1)
        return httpx.Response(int(status), content=body.encode())


# Every node this process starts, in any cluster: slot namespaces and links are host-wide names,
# so two clusters at once (a test's and a benchmark's, say) must not share one.
_NODES_STARTED = itertools.count()
_DIGITS = string.digits + string.ascii_lowercase


def _slot_prefix() -> str:
    """The next node's network prefix: the process's own (`PREFIX`, 9 characters) and two more,
    within the 11 a slot's interface names leave (`<prefix>-255` in 15)."""
    high, low = divmod(next(_NODES_STARTED), len(_DIGITS))
    return f"{PREFIX}{_DIGITS[high]}{_DIGITS[low]}"


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def _link(gateway_ns: str, node_ns: str, index: int) -> str:
    """A veth pair from the gateway's namespace to the node's; the node's address."""
    _sh("ip", "-n", gateway_ns, "link", "add", f"n{index}", "type", "veth",
        "peer", "name", "gw0", "netns", node_ns)  # fmt: skip
    _sh("ip", "-n", gateway_ns, "addr", "add", f"10.250.{index}.1/30", "dev", f"n{index}")
    _sh("ip", "-n", gateway_ns, "link", "set", f"n{index}", "up")
    _sh("ip", "-n", node_ns, "addr", "add", f"10.250.{index}.2/30", "dev", "gw0")
    _sh("ip", "-n", node_ns, "link", "set", "gw0", "up")
    # Nodes reach each other through the gateway's namespace, which forwards between its links,
    # as nodes on one network would: without it a node's peers (its chunk route, issue 34) were
    # unreachable from the others and every pull fell back to S3.
    _sh("ip", "-n", node_ns, "route", "add", "10.250.0.0/16", "via", f"10.250.{index}.1")
    return f"10.250.{index}.2:{NODE_PORT}"


def _drop_namespaces(prefix: str) -> None:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.startswith(prefix)):
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@contextmanager
def _s3_server(gateway: Gateway, log: Path) -> Iterator[None]:
    """moto's S3 server in the gateway's namespace, on every address, with the bucket made."""
    with log.open("ab") as log_file:
        server = subprocess.Popen(
            in_netns(gateway.netns, sys.executable, "-m", "moto.server",
                     "-H", "0.0.0.0", "-p", str(S3_PORT)),
            env=gateway.env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        make_bucket = (
            "import boto3, sys, time\n"
            "for _ in range(100):\n"
            "    try:\n"
            f"        boto3.client('s3', endpoint_url='http://127.0.0.1:{S3_PORT}')"
            f".create_bucket(Bucket='{BUCKET}'); sys.exit(0)\n"
            "    except Exception: time.sleep(0.2)\n"
            "sys.exit(1)\n"
        )
        code, out = gateway.run([sys.executable, "-c", make_bucket], env=S3_CREDENTIALS)
        assert code == 0, out + log.read_text()
        yield
    finally:
        stop_group(server, grace_s=5)


@contextmanager
def cluster(
    scratch: Path,
    node_ids: list[str],
    settings: Mapping[str, str],
    shared_repository: bool = False,
) -> Iterator[Cluster]:
    """Nodes `node_ids` (homes under `scratch`, guest images prepared there beforehand) and one
    gateway, not yet started, sharing `settings` (Redis URL, secret, heartbeat) and, with
    `shared_repository`, one S3 snapshot repository."""
    gateway_ns = f"{PREFIX}gw{secrets.token_hex(2)}"
    _sh("ip", "netns", "add", gateway_ns)
    gateway = Gateway(gateway_ns, scratch / "gateway", scratch / "gateway.log", {
        **os.environ, **settings, "AENV_HOME": str(scratch / "gateway"), "PYTHONUNBUFFERED": "1",
    })  # fmt: skip
    slot_prefixes = [_slot_prefix() for _ in node_ids]
    try:
        _sh("ip", "-n", gateway_ns, "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", gateway_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        with ExitStack() as stack:
            if shared_repository:
                stack.enter_context(_s3_server(gateway, scratch / "s3.log"))
            nodes, addresses = {}, {}
            for index, (node_id, prefix) in enumerate(
                zip(node_ids, slot_prefixes, strict=True), start=1
            ):
                address = f"10.250.{index}.2:{NODE_PORT}"
                node_settings = {
                    **settings,
                    "AENV_NODE_ID": node_id,
                    "AENV_NODE_ADDRESS": address,
                    # Slot namespaces are global names: one prefix per node keeps them apart.
                    "AENV_NETWORK_PREFIX": prefix,
                    "AENV_NETWORK_CIDR": "10.201.0.0/22",
                }
                if shared_repository:
                    node_settings |= {
                        **S3_CREDENTIALS,
                        "AENV_REPOSITORY": f"s3://{BUCKET}/cluster",
                        # The gateway's end of this node's link.
                        "AENV_REPOSITORY_ENDPOINT": f"http://10.250.{index}.1:{S3_PORT}",
                    }
                node = stack.enter_context(
                    server_in_namespace(
                        scratch / node_id, command="node", settings=node_settings, host="0.0.0.0"
                    )
                )
                addresses[node_id] = _link(gateway_ns, node.netns, index)
                nodes[node_id] = node
            try:
                yield Cluster(gateway, nodes, addresses)
            finally:
                gateway.stop()
    finally:
        for prefix in [gateway_ns, *(f"{p}-" for p in slot_prefixes)]:
            _drop_namespaces(prefix)
