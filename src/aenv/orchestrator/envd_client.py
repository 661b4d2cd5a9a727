"""What the host says to a sandbox's envd: wait for `/health`, then `POST /init`.

`/init` runs after every boot and restore: it installs the sandbox's env vars and access token,
sets the clock and hostname, and reseeds the guest RNG with host entropy (clones of one snapshot
otherwise share RNG state).
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
from collections.abc import Mapping
from datetime import UTC, datetime

import httpx

ENVD_PORT = 49983
ENTROPY_BYTES = 64


class EnvdUnavailable(RuntimeError):
    """envd did not answer in time."""


async def wait_healthy(client: httpx.AsyncClient, base_url: str, timeout: float) -> float:
    """Poll `/health` until it answers 2xx; returns the seconds it took."""
    start = time.monotonic()
    deadline = start + timeout
    delay = 0.005
    while True:
        try:
            response = await client.get(f"{base_url}/health", timeout=2.0)
            if response.is_success:
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise EnvdUnavailable(f"envd at {base_url} did not become healthy in {timeout:.0f} s")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.2)


async def init(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    current_token: str | None,
    new_token: str | None,
    env_vars: Mapping[str, str],
    hostname: str,
    timeout: float,
    default_user: str | None = None,
    default_workdir: str | None = None,
) -> None:
    """Configure envd; retries transport errors until `timeout` (a restored guest's network may
    need a moment)."""
    body: dict[str, object] = {
        "envVars": dict(env_vars),
        "accessToken": new_token,
        "hostname": hostname,
        "timestamp": datetime.now(UTC).isoformat(),
        "entropy": base64.b64encode(os.urandom(ENTROPY_BYTES)).decode(),
    }
    if default_user is not None:
        body["defaultUser"] = default_user
    if default_workdir is not None:
        body["defaultWorkdir"] = default_workdir
    headers = {"X-Access-Token": current_token} if current_token else {}
    deadline = time.monotonic() + timeout
    while True:
        try:
            response = await client.post(
                f"{base_url}/init", json=body, headers=headers, timeout=5.0
            )
        except httpx.TransportError as e:
            if time.monotonic() > deadline:
                raise EnvdUnavailable(f"envd at {base_url} unreachable: {e!r}") from e
            await asyncio.sleep(0.02)
            continue
        if response.status_code != 204:
            raise EnvdUnavailable(f"envd /init answered {response.status_code}: {response.text}")
        return


async def sync(client: httpx.AsyncClient, base_url: str, token: str | None) -> None:
    """Have the guest write its dirty pages to disk (before a filesystem-only save)."""
    headers = {"X-Access-Token": token} if token else {}
    try:
        response = await client.post(f"{base_url}/sync", headers=headers, timeout=60.0)
    except httpx.TransportError as e:
        raise EnvdUnavailable(f"envd at {base_url} unreachable: {e!r}") from e
    if response.status_code != 204:
        raise EnvdUnavailable(f"envd /sync answered {response.status_code}: {response.text}")
