"""A real SOCKS5 server for egress proxy tests: microsocks (RFC 1928 with RFC 1929
credentials) in a test's network namespace, in a mount namespace of its own whose /etc/hosts
is the test's, so the names it resolves for clients are the test's choice."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.support.wait import eventually_sync

PORT = 1080
USER, PASSWORD = "tenant", "s3cret"


@contextlib.contextmanager
def socks_server(netns: str, listen: str, bind: str, names: dict[str, str]) -> Iterator[None]:
    """microsocks on `listen`:PORT in `netns`, asking for USER and PASSWORD; its outgoing
    connections leave from `bind`, and it resolves `names` (name -> IPv4 address)."""
    if shutil.which("microsocks") is None:
        raise RuntimeError("microsocks is not installed (scripts/install-system-deps.sh)")
    scratch = Path(tempfile.mkdtemp(prefix="aenv-socks-"))
    hosts = scratch / "hosts"
    hosts.write_text("".join(f"{a} {n}\n" for n, a in {"localhost": "127.0.0.1", **names}.items()))
    script = f'mount --bind "{hosts}" /etc/hosts && exec microsocks "$@"'
    args = ["-i", listen, "-p", str(PORT), "-u", USER, "-P", PASSWORD, "-b", bind]
    server = subprocess.Popen(
        ["ip", "netns", "exec", netns, "unshare", "-m", "sh", "-c", script, "sh", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_listening(netns, listen, server)
        yield
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(scratch, ignore_errors=True)


def _wait_listening(netns: str, listen: str, server: subprocess.Popen[bytes]) -> None:
    def listening() -> bool:
        if server.poll() is not None:
            raise RuntimeError(f"microsocks exited before it listened on {listen}:{PORT}")
        return bool(
            subprocess.run(
                ["ip", "netns", "exec", netns, "ss", "-ltnH", f"src {listen}:{PORT}"],
                capture_output=True, text=True, check=True,
            ).stdout.strip()
        )  # fmt: skip

    eventually_sync(listening, f"microsocks listened on {listen}:{PORT} in {netns}")
