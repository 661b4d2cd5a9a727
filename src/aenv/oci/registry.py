"""A small OCI distribution (registry v2) client: manifests and blobs, read-only.

Why not a library: the maintained Python registry client, `oras` (oras-py), is synchronous
(requests), made for pushing and pulling OCI artifacts, and has no platform selection in
manifest lists, no resumable (Range) blob downloads and no parallel downloads; the rest of the
node is asyncio on httpx. The protocol subset a pull needs is small: GET a manifest, GET blobs,
and answer 401 challenges (Bearer tokens from the realm, or Basic credentials).
"""

from __future__ import annotations

import base64
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from aenv.oci.blobs import BlobCache, DigestMismatchError, PartialBlob, sha256_digest
from aenv.oci.errors import ImageError
from aenv.oci.reference import Reference

MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
MAX_MANIFEST_BYTES = 4 << 20  # the distribution spec's suggested limit
_CHUNK = 1 << 20
_PARAM = re.compile(r'(\w+)="([^"]*)"')


class RegistryError(ImageError):
    """The registry refused or failed a request."""


class AuthError(RegistryError):
    """Credentials missing or rejected."""


class NotFoundError(RegistryError):
    """No such repository, tag or blob."""


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str

    def basic(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return f"Basic {base64.b64encode(raw).decode()}"


@dataclass(frozen=True)
class Manifest:
    digest: str
    media_type: str
    data: bytes


class RegistryClient:
    """One repository on one registry. Use as an async context manager."""

    def __init__(self, ref: Reference, credentials: Credentials | None = None) -> None:
        self.ref = ref
        self.credentials = credentials
        self._auth: str | None = None  # the Authorization header that last worked
        self._http = httpx.AsyncClient(
            base_url=ref.base_url,
            follow_redirects=True,  # blobs are often redirected to object storage
            timeout=httpx.Timeout(60, connect=15),
            headers={"User-Agent": "aenv"},
        )

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def manifest(self, reference: str) -> Manifest:
        """Fetch and verify a manifest (by tag or digest)."""
        path = f"/v2/{self.ref.repository}/manifests/{reference}"
        async with self._stream(path, {"Accept": ", ".join(MANIFEST_TYPES)}) as resp:
            data = bytearray()
            async for chunk in resp.aiter_bytes():
                data += chunk
                if len(data) > MAX_MANIFEST_BYTES:
                    raise RegistryError(f"{self.ref}: manifest larger than {MAX_MANIFEST_BYTES}")
            media_type = resp.headers.get("content-type", "").split(";")[0].strip()
            claimed = resp.headers.get("docker-content-digest")
        actual = sha256_digest(bytes(data))
        expected = reference if reference.startswith("sha256:") else claimed
        if expected is not None and expected != actual:
            what = f"manifest {self.ref.repository}@{reference}"
            raise DigestMismatchError(what, expected, actual)
        return Manifest(actual, media_type, bytes(data))

    async def blob(
        self,
        digest: str,
        size: int,
        cache: BlobCache,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        """Download a blob of `size` bytes (as its descriptor says) into the cache, resuming a
        partial download, verifying its digest. `on_bytes` is told the running byte count
        (including bytes already there)."""
        async with cache.partial(digest) as partial:
            if partial is None:
                return
            if partial.offset > size:
                partial.restart()
            if partial.offset < size:  # equal: complete, only the commit was interrupted
                await self._download(digest, size, partial, on_bytes)
            cache.commit(digest, partial)

    async def _download(
        self,
        digest: str,
        size: int,
        partial: PartialBlob,
        on_bytes: Callable[[int], None] | None,
    ) -> None:
        headers = {"Range": f"bytes={partial.offset}-"} if partial.offset else {}
        async with self._stream(f"/v2/{self.ref.repository}/blobs/{digest}", headers) as resp:
            if resp.status_code != 206:
                partial.restart()  # the server sent the whole blob
            if on_bytes:
                on_bytes(partial.offset)
            async for chunk in resp.aiter_raw(_CHUNK):
                partial.write(chunk)
                if partial.offset > size:
                    # Not worth reading further: it cannot be the blob asked for.
                    raise RegistryError(f"{self.ref}: blob {digest} is larger than {size} bytes")
                if on_bytes:
                    on_bytes(partial.offset)

    @asynccontextmanager
    async def _stream(self, path: str, headers: dict[str, str]) -> AsyncIterator[httpx.Response]:
        """A streamed GET; anything but success raises, naming the reference."""
        resp = await self._send(path, headers)
        try:
            if resp.status_code not in (200, 206):
                await resp.aread()
                raise self._error(resp, path)
            yield resp
        finally:
            await resp.aclose()

    def _error(self, resp: httpx.Response, path: str) -> RegistryError:
        if resp.status_code == 404:
            return NotFoundError(f"{self.ref}: not found ({_error_text(resp)})")
        if resp.status_code in (401, 403):
            return AuthError(f"{self.ref}: access denied ({_error_text(resp)})")
        return RegistryError(f"{self.ref}: {path} answered {resp.status_code}: {_error_text(resp)}")

    async def _send(self, path: str, headers: dict[str, str]) -> httpx.Response:
        """GET with whatever auth the registry asks for; one challenge round at most."""
        if self._auth:
            headers = {**headers, "Authorization": self._auth}
        request = self._http.build_request("GET", path, headers=headers)
        resp = await self._http.send(request, stream=True)
        if resp.status_code != 401:
            return resp
        challenge = resp.headers.get("www-authenticate", "")
        await resp.aclose()
        self._auth = await self._authorize(challenge)
        resp = await self._http.send(
            self._http.build_request("GET", path, headers={**headers, "Authorization": self._auth}),
            stream=True,
        )
        if resp.status_code == 401:
            await resp.aclose()
            raise AuthError(f"{self.ref}: authentication failed ({self._who()})")
        return resp

    async def _authorize(self, challenge: str) -> str:
        scheme, _, params = challenge.partition(" ")
        if scheme.lower() == "basic":
            if self.credentials is None:
                raise AuthError(f"{self.ref}: the registry requires credentials")
            return self.credentials.basic()
        if scheme.lower() != "bearer":
            raise AuthError(f"{self.ref}: unsupported authentication challenge {challenge!r}")
        fields = dict(_PARAM.findall(params))
        realm = fields.pop("realm", None)
        if not realm:
            raise AuthError(f"{self.ref}: Bearer challenge without a realm")
        query = {k: v for k, v in fields.items() if k in ("service", "scope")}
        query.setdefault("scope", f"repository:{self.ref.repository}:pull")
        headers = {"Authorization": self.credentials.basic()} if self.credentials else {}
        resp = await self._http.get(realm, params=query, headers=headers)
        if resp.status_code in (401, 403):
            raise AuthError(f"{self.ref}: token request refused ({self._who()})")
        if resp.status_code != 200:
            raise RegistryError(f"{self.ref}: token endpoint answered {resp.status_code}")
        body = resp.json()
        token = body.get("token") or body.get("access_token")
        if not isinstance(token, str) or not token:
            raise AuthError(f"{self.ref}: token endpoint returned no token")
        return f"Bearer {token}"

    def _who(self) -> str:
        return f"as {self.credentials.username}" if self.credentials else "anonymously"


def _error_text(resp: httpx.Response) -> str:
    try:
        errors = resp.json().get("errors") or []
        return "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors) or resp.text[:200]
    except ValueError:
        return resp.text[:200]
