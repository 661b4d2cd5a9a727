"""A node's chunk serving alone, as a process a test can stop, hang or kill: the real internal
gate and chunk route (`api.chunks`) over a real repository's chunk cache, on loopback.

    python -m tests.cluster.chunk_peer CACHE_DIR PORT SECRET

The repository's store is an empty directory: the route reads the cache and nothing else.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import uvicorn
from starlette.applications import Starlette

from aenv.api.app import JSON_ERRORS
from aenv.api.chunks import ChunkRoutes
from aenv.cluster.internal import InternalGate
from aenv.cluster.secret import ClusterSecret
from aenv.storage.repository import ChunkCache, PosixStore, Repository


def main(cache_dir: str, port: str, secret: str) -> None:
    with tempfile.TemporaryDirectory() as store:
        repository = Repository(PosixStore(Path(store)), ChunkCache(Path(cache_dir), 1 << 30))
        app = Starlette(routes=ChunkRoutes(repository).routes(), exception_handlers=JSON_ERRORS)
        gated = InternalGate(app, ClusterSecret(secret))
        # One access line a request on stdout: what a test counts the peer was asked.
        uvicorn.run(gated, host="127.0.0.1", port=int(port), log_level="info")
        repository.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
