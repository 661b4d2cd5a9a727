"""Opening the snapshot repository a node is configured with (`Config.repository`)."""

from __future__ import annotations

from urllib.parse import urlsplit

from aenv.config import Config, ConfigError
from aenv.orchestrator.archive import Archive
from aenv.storage.repository import BlobStore, ChunkCache, PosixStore, Repository, S3Store


def open_store(config: Config) -> BlobStore | None:
    """The blob store of the node's repository, or None when it is switched off."""
    where = config.repository.strip()
    if where == "off":
        return None
    if config.repository_dir is not None:
        return PosixStore(config.repository_dir)
    if where.startswith("s3://"):
        url = urlsplit(where)
        if not url.netloc:
            raise ConfigError(f"repository {where!r}: s3:// needs a bucket name")
        return S3Store(
            url.netloc, endpoint_url=config.repository_endpoint, prefix=url.path.strip("/")
        )
    raise ConfigError(f"repository {where!r}: use a directory, s3://bucket/prefix or off")


def open_archive(config: Config) -> Archive | None:
    """The node's archive, or None when the repository is switched off."""
    store = open_store(config)
    if store is None:
        return None
    cache = ChunkCache(config.paths.chunk_cache, config.repository_cache_mb << 20)
    # A cluster node's copies may be pulled by another node: they carry their images.
    return Archive(Repository(store, cache), config.home, portable=config.redis_url is not None)
