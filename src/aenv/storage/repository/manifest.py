"""Manifests: what a stored tree is, as JSON, named by the SHA-256 of that JSON.

A manifest lists a tree's regular files (relative path, size, permission bits) and, per file,
one entry per chunk: the chunk's digest, or null for an all-zero chunk (a hole). It also carries
the caller's name and metadata. Its id is the hash of its bytes, so reading it back verifies it
like any chunk, and a manifest, once written, never changes.

    {"format": 1, "name": "sandbox-x/pause", "created": "2026-12-03T10:00:00+00:00",
     "chunk_size": 1048576, "metadata": {...},
     "files": [{"path": "memory", "size": 268435456, "mode": 420,
                "chunks": ["9f86d0...", null, ...]}]}
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError

from aenv.storage.repository.errors import BlobNotFound, CorruptManifest, ManifestNotFound
from aenv.storage.repository.store import BlobStore

FORMAT = 1
PREFIX = "manifests/"
_ID = re.compile(r"[0-9a-f]{64}")
_Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, `/`-separated
    size: int
    mode: int  # permission bits
    chunks: tuple[str | None, ...]  # digest per chunk; None: all zeros, stored nowhere


@dataclass(frozen=True)
class Manifest:
    id: str
    name: str
    created: datetime
    chunk_size: int
    files: tuple[FileEntry, ...]
    metadata: dict[str, Any]

    @property
    def size(self) -> int:
        """Bytes of the tree as files (holes included)."""
        return sum(f.size for f in self.files)

    def digests(self) -> set[str]:
        return {d for f in self.files for d in f.chunks if d is not None}


class _FileDoc(BaseModel):
    path: str
    size: Annotated[int, Field(ge=0)]
    mode: Annotated[int, Field(ge=0, le=0o7777)]
    chunks: list[_Digest | None]


class _Doc(BaseModel):
    format: Literal[1]
    name: str
    created: datetime
    chunk_size: Annotated[int, Field(gt=0)]
    metadata: dict[str, Any]
    files: list[_FileDoc]


def manifest_key(manifest_id: str) -> str:
    if not is_manifest_id(manifest_id):
        raise ValueError(f"not a manifest id: {manifest_id!r}")
    return f"{PREFIX}{manifest_id}.json"


def is_manifest_id(text: str) -> bool:
    return _ID.fullmatch(text) is not None


def id_of(key: str) -> str | None:
    """The manifest id a store key names, or None for anything else under the prefix."""
    name = key.removeprefix(PREFIX).removesuffix(".json")
    return name if key.endswith(".json") and is_manifest_id(name) else None


def safe_path(path: str) -> bool:
    """Relative, normalised, inside the tree: nothing a restore could write outside `dest`."""
    parts = path.split("/")
    return (
        bool(path)
        and not PurePosixPath(path).is_absolute()
        and all(p not in ("", ".", "..") for p in parts)
    )


def build(
    name: str,
    created: datetime,
    chunk_size: int,
    files: list[FileEntry],
    metadata: dict[str, Any],
) -> tuple[Manifest, bytes]:
    """A new manifest and the bytes to store; its id is their hash."""
    draft = Manifest("", name, created, chunk_size, tuple(files), metadata)
    data = _dumps(draft)
    return replace(draft, id=hashlib.sha256(data).hexdigest()), data


def _dumps(manifest: Manifest) -> bytes:
    doc = {
        "format": FORMAT,
        "name": manifest.name,
        "created": manifest.created.isoformat(),
        "chunk_size": manifest.chunk_size,
        "metadata": manifest.metadata,
        "files": [
            {"path": f.path, "size": f.size, "mode": f.mode, "chunks": list(f.chunks)}
            for f in manifest.files
        ],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def loads(manifest_id: str, data: bytes) -> Manifest:
    """The manifest stored under `manifest_id`; raises `CorruptManifest` unless intact."""
    if hashlib.sha256(data).hexdigest() != manifest_id:
        raise CorruptManifest(manifest_id, "its bytes do not match its id")
    try:
        doc = _Doc.model_validate_json(data)
    except ValidationError as e:
        raise CorruptManifest(manifest_id, str(e)) from None
    files: list[FileEntry] = []
    for f in doc.files:
        if not safe_path(f.path):
            raise CorruptManifest(manifest_id, f"unsafe path {f.path!r}")
        if len(f.chunks) != -(-f.size // doc.chunk_size):
            raise CorruptManifest(manifest_id, f"{f.path}: chunk count does not match size")
        files.append(FileEntry(f.path, f.size, f.mode, tuple(f.chunks)))
    return Manifest(manifest_id, doc.name, doc.created, doc.chunk_size, tuple(files), doc.metadata)


def read(store: BlobStore, manifest_id: str) -> Manifest:
    """A stored manifest, verified (blocking); raises `ManifestNotFound` or `CorruptManifest`."""
    if not is_manifest_id(manifest_id):
        raise ManifestNotFound(manifest_id)
    try:
        data = store.get(manifest_key(manifest_id))
    except BlobNotFound:
        raise ManifestNotFound(manifest_id) from None
    return loads(manifest_id, data)


def read_if_present(store: BlobStore, manifest_id: str) -> Manifest | None:
    """`read`, but None for a manifest deleted since it was listed."""
    try:
        return read(store, manifest_id)
    except ManifestNotFound:
        return None
