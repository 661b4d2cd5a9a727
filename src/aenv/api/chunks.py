"""A node's chunk cache as its peers read it: `GET /cluster/chunks/{digest}`, for cluster calls
only.

A node restoring a manifest asks the nodes that hold its chunks before the store
(`aenv.storage.repository.sources`, `aenv.cluster.peers`). This route answers from this node's
chunk cache and nothing else: the asker reads the store itself, and a peer relaying the store
would only add a hop. The body is the chunk as stored (one zstd frame), which the asker checks
against the digest. 404 when the cache lacks it. When `SERVING` answers are under way already
the answer is 503 at once, so a busy node sends its asker to the next source instead of making
it queue. Like `api.handoff`'s routes it exists only for calls through the internal API (the
cluster's token): to a user's key it is 404.
"""

from __future__ import annotations

import re
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from aenv.api.errors import APIError
from aenv.api.internal import gateway_only

CHUNK_ROUTE = "/cluster/chunks/{digest}"
CHUNK_TYPE = "application/zstd"
# Answers at once: each holds a chunk (≤ 1 MiB) in memory and a repository thread.
SERVING = 8
_DIGEST = re.compile(r"[0-9a-f]{64}")


class CachedChunks(Protocol):
    async def cached_chunk(self, digest: str) -> bytes | None:
        """The chunk as cached (compressed), or None."""
        ...


class ChunkRoutes:
    def __init__(self, chunks: CachedChunks | None, serving: int = SERVING) -> None:
        """`chunks`: the node's repository (None: a node without one, which holds no chunk)."""
        self.chunks = chunks
        self.serving = serving
        self._busy = 0

    def routes(self) -> list[Route]:
        return [Route(CHUNK_ROUTE, self.chunk, methods=["GET"])]

    async def chunk(self, request: Request) -> Response:
        gateway_only(request)
        digest = request.path_params["digest"]
        if _DIGEST.fullmatch(digest) is None:
            raise APIError(400, f"not a chunk digest (64 lowercase hex digits): {digest!r}")
        if self._busy >= self.serving:
            raise APIError(503, f"serving {self._busy} chunks already: ask another source")
        self._busy += 1
        try:
            blob = None if self.chunks is None else await self.chunks.cached_chunk(digest)
        finally:
            self._busy -= 1
        if blob is None:
            raise APIError(404, f"chunk {digest} is not in this node's cache")
        return Response(blob, media_type=CHUNK_TYPE)
