"""The blob store interface the repository is written against, and what a listing returns.

A store is a flat key -> bytes map with `/`-separated keys (`chunks/ab/ab12...`). Its methods
block; they must be safe to call from many threads at once, because the repository runs them in a
bounded thread pool to overlap I/O. What the repository relies on:

- `put` is atomic: a reader sees the whole new object or none (never a torn one), and once `put`
  returns the object is durable and visible to `get`, `exists` and `list`;
- `list` sees every object whose `put` returned before it started (strong consistency, which
  POSIX directories and S3 provide);
- `delete` of a missing key succeeds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class BlobInfo:
    key: str
    size: int
    modified: float  # seconds since the epoch, by the store's clock


class BlobStore(Protocol):
    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes:
        """The object's bytes; raises `BlobNotFound` if there is none, `StoreUnavailable` (or
        `OSError`, a directory's) when the store cannot answer."""
        ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def list(self, prefix: str) -> Iterator[BlobInfo]:
        """Every object whose key starts with `prefix` (a plain string prefix), in no order."""
        ...
