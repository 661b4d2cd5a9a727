"""Shared helpers for the envd compatibility tests: SDK clients for another envd (with an access
token), raw Connect framing for protocol-level tests, and bounded polling."""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from e2b import AsyncSandbox, ConnectionConfig, Sandbox
from packaging.version import Version

from tests.support.envd_process import envd_in_throwaway_root
from tests.support.ports import free_port

ENVD_VERSION = Version("0.6.13")


@contextmanager
def extra_envd(*args: str) -> Iterator[str]:
    """A second envd (own throwaway root) on a free port, with extra command-line arguments."""
    with envd_in_throwaway_root(free_port(), *args) as url:
        yield url


def _config(url: str, token: str | None) -> ConnectionConfig:
    headers = {"X-Access-Token": token} if token is not None else {}
    return ConnectionConfig(debug=True, sandbox_url=url, extra_sandbox_headers=headers)


def sandbox_for(url: str, token: str | None = None) -> Sandbox:
    """An SDK Sandbox talking to the envd at `url`, sending `token` as the SDK does for a
    secured sandbox (X-Access-Token on every request, signed file URLs)."""
    return Sandbox(
        sandbox_id="debug_sandbox_id",
        sandbox_domain=None,
        envd_version=ENVD_VERSION,
        envd_access_token=token,
        traffic_access_token=None,
        connection_config=_config(url, token),
    )


def async_sandbox_for(url: str, token: str | None = None) -> AsyncSandbox:
    return AsyncSandbox(
        sandbox_id="debug_sandbox_id",
        sandbox_domain=None,
        envd_version=ENVD_VERSION,
        envd_access_token=token,
        traffic_access_token=None,
        connection_config=_config(url, token),
    )


def envelope(message: dict[str, Any] | bytes, flags: int = 0) -> bytes:
    """One Connect streaming envelope: flag byte, big-endian length, payload."""
    payload = message if isinstance(message, bytes) else json.dumps(message).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


def parse_envelopes(body: bytes) -> list[tuple[int, Any]]:
    """Split a Connect streaming response into (flags, decoded JSON) pairs."""
    out: list[tuple[int, Any]] = []
    offset = 0
    while offset < len(body):
        flags, length = struct.unpack_from(">BI", body, offset)
        offset += 5
        out.append((flags, json.loads(body[offset : offset + length])))
        offset += length
    return out


STREAM_HEADERS = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
UNARY_HEADERS = {"Content-Type": "application/json", "Connect-Protocol-Version": "1"}


def assert_envd_serves(sandbox: Sandbox, url: str) -> None:
    """envd still answers health checks and runs commands (after some bad input)."""
    assert httpx.get(f"{url}/health", timeout=10).status_code == 204
    assert sandbox.commands.run("echo still-alive").stdout == "still-alive\n"


def unique_sleep() -> str:
    """A `sleep` command line no other test uses, to find exactly its process in /proc."""
    return f"sleep 1000.{random.randrange(10**9):09d}"


def pids_in_sandbox(sandbox: Sandbox, pattern: str) -> list[int]:
    """PIDs of processes in the sandbox whose command line contains `pattern` (from /proc). The
    pattern travels in an env var so this probe's own command line does not match it."""
    script = (
        "for d in /proc/[0-9]*; do "
        'c=$(tr "\\0" " " < $d/cmdline 2>/dev/null) || continue; '
        'case "$c" in *"$AENV_PATTERN"*) echo ${d#/proc/};; esac; done'
    )
    out = sandbox.commands.run(script, user="root", envs={"AENV_PATTERN": pattern}).stdout
    return [int(p) for p in out.split()]
