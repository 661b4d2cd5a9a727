"""The host's client of one guest's envd: its address, its access token, and the node's shared
HTTP client. Every host-side caller (the orchestrator, template builds, metrics) talks to envd
through it: it is the one place that names envd's HTTP routes and sends its token.

`/init` runs after every boot and restore: it installs the sandbox's env vars and access token,
sets the clock and hostname, and reseeds the guest RNG with host entropy (clones of one snapshot
otherwise share RNG state).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import os
import ssl
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import pyqwest

from aenv.envd import ENVD_PORT
from aenv.envd.auth import TOKEN_HEADER

ENTROPY_BYTES = 64
# A file write or a COPY of a large archive may take long to answer.
_FILE_TIMEOUT = httpx.Timeout(60.0, read=None)


class EnvdUnavailable(RuntimeError):
    """envd did not answer in time, or answered with an error."""


class EnvdRefused(EnvdUnavailable):
    """envd answered `route` with the error `status`; `reason` is its own message."""

    def __init__(self, route: str, status: int, reason: str) -> None:
        super().__init__(f"envd {route} answered {status}: {reason}")
        self.status = status
        self.reason = reason


def http_client() -> httpx.AsyncClient:
    """An HTTP client for envds, which speak plain HTTP. It loads no CA store, which httpx's
    default client does (≈ 30 ms of CPU per client, paid at every node start and build): an
    HTTPS URL given to it fails verification. It ignores the host's proxy settings
    (`HTTP_PROXY`, `ALL_PROXY`): a guest is reached on the node's own slot network, never
    through a proxy, which would see every sandbox's token."""
    return httpx.AsyncClient(verify=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), trust_env=False)


# reqwest, under pyqwest, reads the host's proxy variables unless a proxy is configured: this
# one excludes every host (names by "*", addresses by the two whole ranges), so none is used.
_NO_PROXY = pyqwest.Proxy("http://127.0.0.1:9", no_proxy="*,0.0.0.0/0,::/0")


def rpc_transport() -> pyqwest.HTTPTransport:
    """A connection pool for envd's Connect RPC clients, which, as `http_client`, reach the
    guest directly whatever the host's proxy settings say."""
    return pyqwest.HTTPTransport(proxy=_NO_PROXY)


@dataclass(frozen=True)
class EnvdClient:
    # Shared by every guest of a node: one connection pool, not one per call.
    http: httpx.AsyncClient
    host: str
    # None until `/init` gave the guest one (a cold-booted envd has none).
    token: str | None = None
    # Where envd is reached when not on the guest's own address: a cluster node's internal
    # data plane (`aenv.gateway.shells`), which `via_headers` name the sandbox and port to.
    via: str | None = None
    via_headers: tuple[tuple[str, str], ...] = ()

    @property
    def url(self) -> str:
        return self.via or f"http://{self.host}:{ENVD_PORT}"

    def headers(self, user: str | None = None) -> dict[str, str]:
        """The access token, and the user to act as for the process and filesystem services."""
        headers = dict(self.via_headers)
        if self.token:
            headers[TOKEN_HEADER] = self.token
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

    async def trust_egress_ca(self, certificate: bytes) -> None:
        """Have the guest trust the node's egress CA (`aenv.envd.trust`); after `/init`, which
        resets the env this adds to."""
        body = {"certificate": certificate.decode()}
        await self._request("POST", "/aenv/egress-ca", json=body, timeout=30.0)

    async def sync(self) -> None:
        """Have the guest write its dirty pages to disk (before a filesystem-only save)."""
        await self._request("POST", "/sync", timeout=60.0)

    async def release_volumes(self, mounts: Sequence[Mapping[str, str]]) -> bool:
        """Have the guest unmount its volumes before a save with memory; False when one is in
        use (all stay mounted)."""
        return await self._volumes("release", mounts)

    async def mount_volumes(self, mounts: Sequence[Mapping[str, str]]) -> None:
        """Have the guest mount its volumes again after `release_volumes`."""
        if not await self._volumes("mount", mounts):
            raise EnvdUnavailable("envd /aenv/volumes/mount answered 409")

    async def _volumes(self, action: str, mounts: Sequence[Mapping[str, str]]) -> bool:
        body = {"volumeMounts": [dict(m) for m in mounts]}
        try:
            await self._request("POST", f"/aenv/volumes/{action}", json=body, timeout=30.0)
        except EnvdRefused as e:
            if e.status == 409:
                return False
            raise
        return True

    async def metrics(self) -> dict[str, float]:
        """envd's current resource sample from inside the guest (CPU, memory, disk)."""
        response = await self._request("GET", "/metrics", timeout=5.0)
        sample: dict[str, float] = response.json()
        return sample

    async def read_file(self, path: str, user: str) -> bytes:
        """The content of the guest's file at `path`, read as `user`."""
        response = await self._request(
            "GET", "/files", params={"path": path}, user=user, timeout=_FILE_TIMEOUT
        )
        return response.content

    @contextlib.asynccontextmanager
    async def open_file(self, path: str, user: str) -> AsyncIterator[httpx.Response]:
        """The guest's file at `path`, read as `user`, as an answer whose body is still to be
        read (a download passes it on as it comes); `EnvdRefused`, `EnvdUnavailable` as for
        every call."""
        request = self.http.build_request(
            "GET",
            f"{self.url}/files",
            params={"path": path},
            headers=self.headers(user),
            timeout=_FILE_TIMEOUT,
        )
        try:
            response = await self.http.send(request, stream=True)
        except httpx.TransportError as e:
            raise EnvdUnavailable(f"envd at {self.url} unreachable: {e!r}") from e
        try:
            if not response.is_success:
                await response.aread()
                raise EnvdRefused("/files", response.status_code, _reason(response))
            yield response
        finally:
            await response.aclose()

    async def write_file(
        self, path: str, data: bytes | Path | BinaryIO, user: str = "root"
    ) -> None:
        """Write `data`, or the file at that host path or open file, to `path` in the guest as
        `user`; a file is sent as it is read, never held whole in memory."""
        with contextlib.ExitStack() as stack:
            content = stack.enter_context(data.open("rb")) if isinstance(data, Path) else data
            await self._request(
                "POST",
                "/files",
                params={"path": path, "username": user},
                files={"file": ("upload", content)},
                timeout=_FILE_TIMEOUT,
            )

    async def copy(
        self, archive: str, src: str, dest: str, owner: str, mode: str | None
    ) -> list[str]:
        """Have envd place `src` of the guest's tar `archive` at `dest`, owned by `owner`, with
        `mode` if given (envd's `/aenv/copy`, a template build's COPY); returns what it placed."""
        body = {"archive": archive, "src": src, "dest": dest, "owner": owner, "mode": mode}
        response = await self._request("POST", "/aenv/copy", json=body, timeout=_FILE_TIMEOUT)
        placed: list[str] = response.json()["placed"]
        return placed

    async def _request(
        self,
        method: str,
        route: str,
        *,
        timeout: float | httpx.Timeout,
        user: str | None = None,
        **content: Any,
    ) -> httpx.Response:
        """One call of envd's `route` with the token (and `user`); `EnvdRefused` for an error
        answer, `EnvdUnavailable` when envd does not answer."""
        try:
            response = await self.http.request(
                method, f"{self.url}{route}", headers=self.headers(user), timeout=timeout, **content
            )
        except httpx.TransportError as e:
            raise EnvdUnavailable(f"envd at {self.url} unreachable: {e!r}") from e
        if not response.is_success:
            raise EnvdRefused(route, response.status_code, _reason(response))
        return response


def _reason(response: httpx.Response) -> str:
    """envd's message from its error body (`{"code", "message"}`), else the body as it is."""
    try:
        return str(response.json()["message"])
    except (ValueError, KeyError, TypeError):
        return response.text
