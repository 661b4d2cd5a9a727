"""A real `aenv server` for end-to-end tests, inside a network namespace of its own.

The server changes its host's network (a forwarding sysctl, an nftables table, one veth per
sandbox); run in a namespace the test creates, none of that touches the real host. Clients must
run in that namespace too, so the SDK tests under `inner/` run as a child pytest inside it.
Guest images are prepared beforehand from the root namespace, which has the package mirrors.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from aenv.config import Paths
from aenv.runtime.sweep import reap_strays
from tests.e2e.vmm_procs import SERVER_PID
from tests.support.process_group import stop_group

REPO = Path(__file__).resolve().parents[2]
# Slot namespaces are global names: a prefix of its own per run keeps concurrent runs apart.
PREFIX = f"aenvt{secrets.token_hex(2)}"


def in_netns(netns: str, *argv: str) -> list[str]:
    # nsenter, not `ip netns exec`: the latter remounts /sys, hiding the cgroup hierarchies.
    return ["nsenter", f"--net=/run/netns/{netns}", "--", *argv]


def with_resolv_conf(resolv_conf: Path, argv: list[str]) -> list[str]:
    """`argv` in a mount namespace of its own whose /etc/resolv.conf is `resolv_conf`."""
    script = (
        f"mount --bind {shlex.quote(str(resolv_conf))} /etc/resolv.conf && exec {shlex.join(argv)}"
    )
    return ["unshare", "--mount", "sh", "-c", script]


@dataclass
class ServerNs:
    netns: str
    home: Path
    port: int
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    # The `aenv` command that runs the node (`node` for a cluster member).
    command: str = "server"
    # The address it listens on (a cluster node listens where its gateway reaches it).
    host: str = "127.0.0.1"
    # The /etc/resolv.conf it sees (in a mount namespace of its own); None: the host's.
    resolv_conf: Path | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "aenv.cli", self.command, "--port", str(self.port),
                "--host", self.host]  # fmt: skip
        if self.resolv_conf is not None:
            argv = with_resolv_conf(self.resolv_conf, argv)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                in_netns(self.netns, *argv),
                env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def kill_9(self) -> None:
        """SIGKILL the server process alone: its VMMs live on as orphans, as after a crash."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        stop_group(self.proc, grace_s=60)

    def run(self, *argv: str, timeout: float) -> tuple[int, str]:
        """Run a client command in the namespace; stops early if the server dies."""
        assert self.proc is not None
        with tempfile.TemporaryFile() as out:
            env = {**self.env, SERVER_PID: str(self.proc.pid)}  # nsenter execs the server
            client = subprocess.Popen(
                in_netns(self.netns, *argv), env=env, stdout=out, stderr=subprocess.STDOUT
            )
            deadline = time.monotonic() + timeout
            while client.poll() is None:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    client.kill()
                    client.wait()
                    why = "server exited" if self.proc.poll() is not None else "timed out"
                    out.seek(0)
                    return -1, f"{why}\n{out.read().decode(errors='replace')}"
                time.sleep(0.5)
            out.seek(0)
            return client.returncode, out.read().decode(errors="replace")

    def failure(self, what: str, output: str) -> str:
        """The message of a failed client `what`: its output's end, then the server log's. CI
        shows the head of a long failure, so the pytest inside runs with `--tb=short`."""
        log = self.log.read_text(errors="replace")
        return f"{what} failed:\n{output[-12000:]}\n--- server log ---\n{log[-10000:]}"


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _kill_namespace_processes(netns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    for pid in pids.split():
        with suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _cleanup(host_ns: str) -> None:
    for ns in [*_namespaces(f"{PREFIX}-"), host_ns]:
        _kill_namespace_processes(ns)
    for ns in [*_namespaces(f"{PREFIX}-"), host_ns]:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextmanager
def server_in_namespace(
    home: Path,
    port: int = 3000,
    command: str = "server",
    settings: Mapping[str, str] = {},
    host: str = "127.0.0.1",
    *,
    configured: bool = True,
    resolv_conf: Path | None = None,
) -> Iterator[ServerNs]:
    """`settings` are extra environment variables (`AENV_REDIS_URL`, say). Not `configured`,
    the server runs with its defaults but for its home and the shared guest build cache (a
    cache: where images come from, not how the node behaves). With `resolv_conf`, it sees that
    file as /etc/resolv.conf."""
    host_ns = f"{PREFIX}host{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", host_ns], check=True)
    subprocess.run(["ip", "-n", host_ns, "link", "set", "lo", "up"], check=True)
    guest_cache = os.environ.get("AENV_GUEST_CACHE", str(REPO / "build" / "guest-cache"))
    essential = {
        "AENV_HOME": str(home),
        "AENV_GUEST_CACHE": guest_cache,
        "PYTHONUNBUFFERED": "1",
    }
    # What the suites need of a node (names of their own, small guests, short waits).
    tests = {
        "AENV_NETWORK_PREFIX": PREFIX,
        "AENV_NETWORK_CIDR": "10.201.0.0/16",
        "AENV_WARM_SLOTS_LOW": "2",
        "AENV_WARM_SLOTS_HIGH": "4",
        "AENV_BUILD_READY_TIMEOUT": "30",  # the failing-readyCmd build test waits this long
        "AENV_BUILD_CACHE_LAYERS": "3",  # low enough that the build tests overflow it
        # No route to the registries here; the code interpreter suite builds its own template.
        "AENV_PUBLISH_CODE_INTERPRETER": "false",
        # Small guests: the load test holds 200 of them at once.
        "AENV_SANDBOX_MEMORY_MB": "256",
        # The load test's 200 creates at once must not depend on how much of the key's burst
        # (200 by default) the tests just before it drew on; tests/api checks the rate limit.
        "AENV_KEY_REQUEST_BURST": "1000",
        # The events suite's webhook receiver listens on the namespace's loopback; its retry
        # comes at once.
        "AENV_WEBHOOK_INTERNAL_ALLOWED": "true",
        "AENV_WEBHOOK_RETRY_DELAY": "0.2",
    }
    env = {**os.environ, **(tests if configured else {}), **essential, **settings}
    home.mkdir(parents=True, exist_ok=True)
    server = ServerNs(
        host_ns, home, port, home / "server.log", env, command=command, host=host,
        resolv_conf=resolv_conf,
    )  # fmt: skip
    try:
        server.start()
        yield server
    finally:
        server.stop()
        time.sleep(0.2)
        _cleanup(host_ns)
        # VMMs a server killed with kill -9 (and not restarted) left: jailed ones run in
        # namespaces of their own, where the namespace cleanup does not reach them.
        reap_strays(home)
        # Template and sandbox memory lives on tmpfs, outside the data dir the caller removes.
        shutil.rmtree(Paths(home).memory, ignore_errors=True)
