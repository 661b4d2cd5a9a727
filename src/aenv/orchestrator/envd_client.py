"""The host's client of one guest's envd: its address, its access token, and the node's shared
HTTP client. Every host-side caller (the orchestrator, template builds, metrics) talks to envd
through it.

`/init` runs after every boot and restore: it installs the sandbox's env vars and access token,
sets the clock and hostname, and reseeds the guest RNG with host entropy (clones of one snapshot
otherwise share RNG state).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx

from aenv.envd import ENVD_PORT
from aenv.envd.auth import TOKEN_HEADER

ENTROPY_BYTES = 64


class EnvdUnavailable(RuntimeError):
    """envd did not answer in time, or answered with an error."""


@dataclass(frozen=True)
class EnvdClient:
    # Shared by every guest of a node: one connection pool, not one per call.
    http: httpx.AsyncClient
    host: str
    # None until `/init` gave the guest one (a cold-booted envd has none).
    token: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{ENVD_PORT}"

    def headers(self, user: str | None = None) -> dict[str, str]:
        """The access token, and the user to act as for the process and filesystem services."""
        headers = {TOKEN_HEADER: self.token} if self.token else {}
        if user is not None:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
        return headers

    async def wait_healthy(self, timeout: float) -> float:
        """Poll `/health` until it answers 2xx; returns the seconds it took."""
        start = time.monotonic()
        deadline = start + timeout
        delay = 0.005
        while True:
            try:
                response = await self.http.get(f"{self.url}/health", timeout=2.0)
                if response.is_success:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise EnvdUnavailable(
                    f"envd at {self.url} did not become healthy in {timeout:.0f} s"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    async def init(
        self,
        *,
        new_token: str | None,
        env_vars: Mapping[str, str],
        hostname: str,
        timeout: float,
        default_user: str | None = None,
        default_workdir: str | None = None,
        volume_mounts: Sequence[Mapping[str, str]] = (),
    ) -> EnvdClient:
        """Configure envd; retries transport errors until `timeout` (a restored guest's network
        may need a moment). Returns the client holding the new token."""
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
        if volume_mounts:
            body["volumeMounts"] = [dict(m) for m in volume_mounts]
        deadline = time.monotonic() + timeout
        while True:
            try:
                response = await self.http.post(
                    f"{self.url}/init", json=body, headers=self.headers(), timeout=5.0
                )
            except httpx.TransportError as e:
                if time.monotonic() > deadline:
                    raise EnvdUnavailable(f"envd at {self.url} unreachable: {e!r}") from e
                await asyncio.sleep(0.02)
                continue
            if response.status_code != 204:
                raise EnvdUnavailable(
                    f"envd /init answered {response.status_code}: {response.text}"
                )
            return dataclasses.replace(self, token=new_token)

    async def sync(self) -> None:
        """Have the guest write its dirty pages to disk (before a filesystem-only save)."""
        try:
            response = await self.http.post(
                f"{self.url}/sync", headers=self.headers(), timeout=60.0
            )
        except httpx.TransportError as e:
            raise EnvdUnavailable(f"envd at {self.url} unreachable: {e!r}") from e
        if response.status_code != 204:
            raise EnvdUnavailable(f"envd /sync answered {response.status_code}: {response.text}")

    async def release_volumes(self, mounts: Sequence[Mapping[str, str]]) -> bool:
        """Have the guest unmount its volumes before a save with memory; False when one is in
        use (all stay mounted)."""
        return await self._volumes("release", mounts)

    async def mount_volumes(self, mounts: Sequence[Mapping[str, str]]) -> None:
        """Have the guest mount its volumes again after `release_volumes`."""
        if not await self._volumes("mount", mounts):
            raise EnvdUnavailable("envd /aenv/volumes/mount answered 409")

    async def _volumes(self, action: str, mounts: Sequence[Mapping[str, str]]) -> bool:
        try:
            response = await self.http.post(
                f"{self.url}/aenv/volumes/{action}",
                json={"volumeMounts": [dict(m) for m in mounts]},
                headers=self.headers(),
                timeout=30.0,
            )
        except httpx.TransportError as e:
            raise EnvdUnavailable(f"envd at {self.url} unreachable: {e!r}") from e
        if response.status_code == 409:
            return False
        if response.status_code != 204:
            raise EnvdUnavailable(
                f"envd /aenv/volumes/{action} answered {response.status_code}: {response.text}"
            )
        return True

    async def metrics(self) -> dict[str, float]:
        """envd's current resource sample from inside the guest (CPU, memory, disk)."""
        try:
            response = await self.http.get(
                f"{self.url}/metrics", headers=self.headers(), timeout=5.0
            )
            response.raise_for_status()
        except httpx.HTTPError as e:
            raise EnvdUnavailable(f"envd /metrics at {self.url}: {e}") from e
        sample: dict[str, float] = response.json()
        return sample
