"""Pulling an image: resolve the reference to one platform's manifest, then fetch its config
and layers into the blob cache (several layers at once). Nothing is unpacked here."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.oci.blobs import BlobCache
from aenv.oci.reference import Reference, parse
from aenv.oci.registry import Credentials, Manifest, RegistryClient, RegistryError

INDEX_TYPES = frozenset(
    {
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
    }
)
IMAGE_TYPES = frozenset(
    {
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    }
)
PARALLEL_LAYERS = 4


@dataclass(frozen=True)
class Platform:
    os: str = "linux"
    architecture: str = "amd64"
    variant: str | None = None

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)


@dataclass(frozen=True)
class Layer:
    digest: str
    size: int
    media_type: str


@dataclass(frozen=True)
class PulledImage:
    """An image whose config and layers are all in the blob cache, verified."""

    reference: Reference
    digest: str  # of the platform's image manifest
    index_digest: str | None  # of the manifest list it was selected from, if any
    platform: Platform
    config_digest: str  # the image ID, as docker shows it
    config: dict[str, Any]  # the image configuration document
    layers: tuple[Layer, ...]  # bottom first
    cache: BlobCache

    @property
    def diff_ids(self) -> tuple[str, ...]:
        """Digests of the layers uncompressed, from the config (pull checked there is one per
        layer)."""
        return tuple(self.config["rootfs"]["diff_ids"])

    def layer_path(self, layer: Layer) -> Path:
        return self.cache.path(layer.digest)


@dataclass(frozen=True)
class PullProgress:
    """A layer's download progress; `done` is the bytes present so far (cached: all of them)."""

    digest: str
    size: int
    done: int


ProgressCallback = Callable[[PullProgress], None]


class PlatformNotFoundError(RegistryError):
    """A manifest list without the requested platform."""


async def pull(
    ref: str,
    cache: Path,
    *,
    credentials: Credentials | None = None,
    platform: Platform | None = None,
    progress: ProgressCallback | None = None,
) -> PulledImage:
    """Fetch `ref` for `platform` (linux/amd64) into the blob cache `<cache>/blobs`."""
    reference = parse(ref)
    want = platform or Platform()
    blobs = BlobCache(cache / "blobs")
    async with RegistryClient(reference, credentials) as client:
        manifest = await client.manifest(reference.reference)
        index_digest = None
        doc = _json(manifest, str(reference))
        if _media_type(manifest, doc) in INDEX_TYPES:
            index_digest = manifest.digest
            manifest = await client.manifest(_select(doc, want, reference))
            doc = _json(manifest, str(reference))
        if _media_type(manifest, doc) not in IMAGE_TYPES:
            raise RegistryError(f"{reference}: unsupported manifest type {manifest.media_type!r}")
        try:
            config_digest, config_size = doc["config"]["digest"], int(doc["config"]["size"])
            layers = tuple(
                Layer(d["digest"], int(d["size"]), d.get("mediaType", "")) for d in doc["layers"]
            )
        except (KeyError, TypeError, ValueError) as e:
            raise RegistryError(f"{reference}: malformed image manifest ({e!r})") from e
        await client.blob(config_digest, config_size, blobs)
        config = json.loads(blobs.path(config_digest).read_bytes())
        diff_ids = (
            (config.get("rootfs") or {}).get("diff_ids") if isinstance(config, dict) else None
        )
        if not isinstance(diff_ids, list) or len(diff_ids) != len(layers):
            raise RegistryError(f"{reference}: image config does not list one diff_id per layer")

        gate = asyncio.Semaphore(PARALLEL_LAYERS)

        async def fetch(layer: Layer) -> None:
            def report(done: int) -> None:
                if progress:
                    progress(PullProgress(layer.digest, layer.size, done))

            async with gate:
                await client.blob(layer.digest, layer.size, blobs, report)
            report(layer.size)

        # A layer listed twice is downloaded once.
        unique = {layer.digest: layer for layer in layers}.values()
        await asyncio.gather(*(fetch(layer) for layer in unique))
    return PulledImage(
        reference, manifest.digest, index_digest, want, config_digest, config, layers, blobs
    )


def _json(manifest: Manifest, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(manifest.data)
    except ValueError as e:
        raise RegistryError(f"{what}: manifest is not JSON") from e
    if not isinstance(doc, dict):
        raise RegistryError(f"{what}: manifest is not a JSON object")
    return doc


def _media_type(manifest: Manifest, doc: dict[str, Any]) -> str:
    # OCI manifests may omit mediaType in the body; the response header then says what it is.
    return str(doc.get("mediaType") or manifest.media_type)


def _select(index: dict[str, Any], want: Platform, reference: Reference) -> str:
    available = []
    for entry in index.get("manifests", []):
        p = entry.get("platform") or {}
        have = Platform(p.get("os", ""), p.get("architecture", ""), p.get("variant"))
        available.append(str(have))
        if (have.os, have.architecture) != (want.os, want.architecture):
            continue
        if want.variant is None or have.variant == want.variant:
            return str(entry["digest"])
    raise PlatformNotFoundError(
        f"{reference}: no {want} image (available: {', '.join(available) or 'none'})"
    )
