"""A real `redis-server` on loopback for cluster tests: its own port and temp dir, no
persistence, stoppable and restartable on the same port (a Redis restart loses everything, as a
wiped or replaced Redis does)."""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.ports import free_port
from tests.support.wait import eventually_sync


class RedisServer:
    """One redis-server process; `url` stays the same across `restart`."""

    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/install-system-deps.sh)")
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        # Also on a unix socket, which reaches processes in other network namespaces.
        self.socket = directory / "redis.sock"
        self.unix_url = f"unix://{self.socket}?db=0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # No RDB or AOF: a restart starts empty, which is the loss the cluster must survive.
        command = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.directory), "--save", "", "--appendonly", "no",
            "--unixsocket", str(self.socket), "--unixsocketperm", "700",
        ]  # fmt: skip
        log = (self.directory / "redis.log").open("ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        eventually_sync(self._answers, "redis-server answered PING")

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"redis-server exited: see {self.directory / 'redis.log'}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Kill it as a crash would (SIGKILL), and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


@contextmanager
def redis_server(directory: Path) -> Iterator[RedisServer]:
    server = RedisServer(directory)
    server.start()
    try:
        yield server
    finally:
        server.stop()
