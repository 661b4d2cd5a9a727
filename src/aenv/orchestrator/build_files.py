"""The files uploaded for template builds' COPY steps, on disk: one gzip (or plain) tar per
(template, files hash) under `$AENV_HOME/build-files/<template id>/<hash>`, written as it
arrives and read from there by the build that copies it into its VM.

What an upload can be checked against as it streams is limited: the SDK's files hash
(`calculate_files_hash`) covers `COPY <src> <dest>` before the files, and only the build's
step names `src` and `dest`. So an upload is checked here for what it carries itself (a tar,
gzipped or not; an RFC 9530 `Content-Digest`/`Repr-Digest` sha-256 when the client sends
one; the host's disk reserve), and against the files hash when a build uses it
(`build_steps.tar_files_hash`), which removes an upload that does not match.

An upload's modification time is its last use (uploaded, found present by the SDK's files
query, or copied by a build); `sweep` removes those unused for `UNUSED_FOR` and those of
deleted templates.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import os
import re
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import BinaryIO

from aenv.orchestrator.reserve import HostReserve

MAX_UPLOAD = 4 << 30
UNUSED_FOR = 24 * 3600  # seconds an upload is kept after its last use
_GZIP_MAGIC = b"\x1f\x8b"
_TAR_MAGIC_AT = 257  # "ustar" in a POSIX or GNU tar header
_DIGEST = re.compile(r"(?:^|,)\s*sha-256\s*=\s*:([A-Za-z0-9+/=]*):\s*(?:,|$)")


class UploadRefused(Exception):
    """An upload not kept (nothing of it is left on disk); `status` is the HTTP answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def declared_sha256(headers: dict[str, str]) -> bytes | None:
    """The sha-256 an RFC 9530 `Content-Digest` or `Repr-Digest` header gives (an upload is
    sent whole, unencoded: both name the same bytes); None without one. Raises UploadRefused
    for a header that is not one."""
    for name in ("content-digest", "repr-digest"):
        value = headers.get(name)
        if value is None:
            continue
        match = _DIGEST.search(value)
        if match is None:
            continue  # other algorithms only: nothing this node checks
        try:
            digest = base64.b64decode(match.group(1), validate=True)
        except binascii.Error as e:
            raise UploadRefused(400, f"{name}: sha-256 is not base64") from e
        if len(digest) != hashlib.sha256().digest_size:
            raise UploadRefused(400, f"{name}: sha-256 is not 32 bytes")
        return digest
    return None


def _looks_like_tar(head: bytes) -> bool:
    if head.startswith(_GZIP_MAGIC):
        return True
    return head[_TAR_MAGIC_AT : _TAR_MAGIC_AT + 5] == b"ustar"


class BuildFiles:
    def __init__(self, directory: Path, reserve: HostReserve) -> None:
        self.directory = directory
        self.reserve = reserve
        # Bytes that uploads under way declared and have not written yet: the free space does
        # not show them, and each would count on the same room.
        self._promised = 0

    def path(self, template_id: str, files_hash: str) -> Path:
        return self.directory / template_id / files_hash

    def touch(self, path: Path) -> bool:
        """Mark an upload used now; False when there is none. Blocking: run it in a thread."""
        try:
            os.utime(path)
        except FileNotFoundError:
            return False
        return True

    def _too_large(self, limit: int) -> UploadRefused:
        if limit >= MAX_UPLOAD:
            return UploadRefused(413, f"an upload is at most {MAX_UPLOAD} bytes")
        return UploadRefused(
            507,
            f"not enough disk: the host can take {limit} more bytes above its reserve "
            f"({self.reserve.disk_mb} MiB, reserve_disk_mb)",
        )

    async def store(
        self,
        template_id: str,
        files_hash: str,
        chunks: AsyncIterator[bytes],
        length: int | None,
        sha256: bytes | None,
    ) -> None:
        """Write an upload to disk as it arrives, then put it in place whole. `length` is the
        size the client declared, `sha256` the digest it declared. Raises UploadRefused: 413
        past `MAX_UPLOAD`, 507 when the data filesystem would go under its reserve, counting
        what the uploads under way declared and have not written yet (a declared length is
        refused before anything is written), 400 for what is not a tar or does not match its
        digest."""
        free_mb = await asyncio.to_thread(self.reserve.free_disk_mb)
        room = ((free_mb - self.reserve.disk_mb) << 20) - self._promised
        limit = min(MAX_UPLOAD, max(room, 0))
        if length is not None and length > limit:
            raise self._too_large(limit)
        promised = length or 0
        self._promised += promised
        digest = hashlib.sha256()
        head = b""
        size = 0
        dest = self.path(template_id, files_hash)
        partial = dest.with_name(f".{files_hash}.{secrets.token_hex(4)}")
        try:
            await asyncio.to_thread(dest.parent.mkdir, parents=True, exist_ok=True)
            with partial.open("wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise self._too_large(limit)
                    if len(head) < _TAR_MAGIC_AT + 5:
                        head += chunk[: _TAR_MAGIC_AT + 5 - len(head)]
                    await asyncio.to_thread(_write, out, digest, chunk)
                    kept = min(len(chunk), promised)
                    promised -= kept
                    self._promised -= kept
            if not _looks_like_tar(head):
                raise UploadRefused(400, "the upload is not a tar archive (gzipped or not)")
            if sha256 is not None and digest.digest() != sha256:
                raise UploadRefused(400, "the upload does not match its sha-256 digest header")
            await asyncio.to_thread(os.replace, partial, dest)
        finally:
            self._promised -= promised
            await asyncio.to_thread(partial.unlink, True)

    def remove_template(self, template_id: str) -> None:
        """Every upload of a template. Blocking: run it in a thread."""
        shutil.rmtree(self.directory / template_id, ignore_errors=True)

    def sweep(self, deleted: Collection[str], now: float | None = None) -> list[Path]:
        """Remove the uploads of the `deleted` templates, and every upload (and a crash's
        partial one) unused for `UNUSED_FOR`; returns what was removed. A template's directory
        stays while the template does: an upload may be creating it. Blocking: run it in a
        thread."""
        now = time.time() if now is None else now
        removed: list[Path] = []
        if not self.directory.is_dir():
            return removed
        for entry in self.directory.iterdir():
            if entry.is_dir() and entry.name in deleted:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
                continue
            # Files directly under the directory: uploads of earlier versions, by hash only.
            files = list(entry.iterdir()) if entry.is_dir() else [entry]
            for file in files:
                try:
                    if now - file.stat().st_mtime > UNUSED_FOR:
                        file.unlink()
                        removed.append(file)
                except FileNotFoundError:
                    continue
        return removed


def _write(out: BinaryIO, digest: hashlib._Hash, chunk: bytes) -> None:
    digest.update(chunk)
    out.write(chunk)
