"""The repository's exceptions: what a caller can catch, each naming what failed and where."""

from __future__ import annotations


class RepositoryError(Exception):
    """Base class: anything the snapshot repository refuses or cannot do."""


class BlobNotFound(RepositoryError):
    """A store has no object under this key."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no object {key!r} in the store")
        self.key = key


class StoreUnavailable(RepositoryError):
    """The store did not answer a read (down, refusing, too slow); nothing was read, and a retry
    later may succeed."""


class ManifestNotFound(RepositoryError):
    def __init__(self, manifest_id: str) -> None:
        super().__init__(f"manifest {manifest_id} does not exist")
        self.manifest_id = manifest_id


class CorruptManifest(RepositoryError):
    """A manifest's bytes do not hash to its id, or are not a valid manifest."""

    def __init__(self, manifest_id: str, reason: str) -> None:
        super().__init__(f"manifest {manifest_id} is corrupt: {reason}")
        self.manifest_id = manifest_id


class ChunkError(RepositoryError):
    """A chunk a manifest needs could not be read back intact."""

    def __init__(self, digest: str, manifest_id: str, path: str, offset: int, problem: str) -> None:
        super().__init__(
            f"chunk {digest} of manifest {manifest_id} ({path} at offset {offset}) {problem}"
        )
        self.digest = digest
        self.manifest_id = manifest_id
        self.path = path
        self.offset = offset


class MissingChunk(ChunkError):
    """The store has no object for a chunk a manifest references."""


class CorruptChunk(ChunkError):
    """A stored chunk does not decompress, or does not hash to its name."""


class UnreachableChunk(ChunkError):
    """No source gave a chunk a manifest needs: no peer had it and the store did not answer.
    The restore fails whole: nothing of it is left."""


class LeaseLost(RepositoryError):
    """An operation outlived its lease: it must not commit what the lease protected."""
