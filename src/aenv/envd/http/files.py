"""`GET /files` (download) and `POST /files` (upload), as the E2B SDKs use them.

Uploads stream straight into their destination (multipart parts or a raw octet-stream body,
optionally gzip-encoded) without buffering whole files. As in infra's envd, a file is written
in place (create/truncate, then chown, then write) so directory watchers see CREATE, CHMOD and
WRITE on the file's own name, which the SDKs' tests rely on.
"""

from __future__ import annotations

import contextlib
import errno
import mimetypes
import os
import stat
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from aenv.envd.auth import TOKEN_HEADER, SignatureError, check_file_access
from aenv.envd.filesystem.entry import METADATA_XATTR_PREFIX, read_metadata, write_metadata
from aenv.envd.filesystem.paths import ensure_dirs
from aenv.envd.settings import Settings
from aenv.envd.users import UnknownUserError, User, resolve_path

CHUNK = 256 * 1024
DRAIN_LIMIT = 64 * 1024 * 1024
METADATA_HEADER_PREFIX = "x-metadata-"


class HTTPFailure(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def json_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _user(request: Request, settings: Settings) -> User:
    name = request.query_params.get("username") or settings.default_user
    try:
        return User.lookup(name)
    except UnknownUserError as e:
        raise HTTPFailure(401, f"error looking up user '{name}': {e}") from e


def _authorize(request: Request, settings: Settings, operation: str) -> None:
    q = request.query_params
    try:
        check_file_access(
            settings.access_token,
            request.headers.get(TOKEN_HEADER),
            path=q.get("path", ""),
            operation=operation,
            username=q.get("username"),
            signature=q.get("signature"),
            expiration=q.get("signature_expiration"),
        )
    except SignatureError as e:
        raise HTTPFailure(401, str(e)) from e


def _resolve(raw: str, user: User, settings: Settings) -> str:
    try:
        return resolve_path(raw, user, settings.default_workdir)
    except ValueError as e:
        raise HTTPFailure(400, f"error expanding and resolving path '{raw}': {e}") from e


def _codings(accept: str) -> dict[str, float]:
    """`Accept-Encoding` as {coding: q}, lower-cased; a malformed q counts as 1."""
    accepted: dict[str, float] = {}
    for item in accept.split(","):
        coding, _, params = item.strip().partition(";")
        q = 1.0
        for param in params.split(";"):
            name, _, value = param.strip().partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 1.0
        if coding.strip():
            accepted[coding.strip().lower()] = q
    return accepted


def _wants_gzip(accepted: dict[str, float]) -> bool:
    """Compress only when the client asks for gzip specifically.

    Infra's envd gzips whenever gzip is the most preferred coding, but HTTP libraries send
    `gzip, deflate` by default as a statement of what they can decode; compressing then costs
    CPU on both sides (and on incompressible data buys nothing), cutting read throughput by
    about 5x. The SDK's `read(gzip=True)` sends `gzip` alone, and a client that refuses
    identity (`identity;q=0`) gets gzip too.
    """
    if accepted.get("gzip", 0) <= 0:
        return False
    others = [c for c, q in accepted.items() if q > 0 and c not in ("gzip", "identity")]
    return _identity_refused(accepted) or not others


def _identity_refused(accepted: dict[str, float]) -> bool:
    """Whether the client refuses an unencoded body (`identity;q=0`, or `*;q=0` without
    accepting identity explicitly), as infra's negotiation decides it."""
    if "identity" in accepted:
        return accepted["identity"] <= 0
    return accepted.get("*", 1.0) <= 0


class _OpenFileResponse(FileResponse):
    """Sends a file we already opened, through its `/proc/self/fd` name: the length announced
    and the bytes sent then come from the same file even when its path is replaced meanwhile
    (an atomic `mv` over it, as programs that update a file do). Starlette's `FileResponse`
    stats the path and opens it again later, and a replaced file of another length cut the
    response short."""

    # Bigger reads than Starlette's 64 KiB mean far fewer thread hops per file.
    chunk_size = 1024 * 1024

    def __init__(self, fd: int, st: os.stat_result, **kwargs: Any) -> None:
        self._fd = fd
        super().__init__(f"/proc/self/fd/{fd}", stat_result=st, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            os.close(self._fd)


async def _gzip_stream(file: BinaryIO) -> AsyncIterator[bytes]:
    compressor = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    with file as f:
        while chunk := f.read(CHUNK):
            if out := compressor.compress(chunk):
                yield out
    yield compressor.flush()


def _until_eof(file: BinaryIO) -> Iterator[bytes]:
    """A file read to its end whatever its size said (Starlette iterates it in a thread)."""
    with file as f:
        while chunk := f.read(CHUNK):
            yield chunk


async def download(request: Request, settings: Settings) -> Response:
    try:
        _authorize(request, settings, "read")
        user = _user(request, settings)
        path = _resolve(request.query_params.get("path", ""), user, settings)
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer.
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):  # (a parent being a file: absent too)
            raise HTTPFailure(404, f"path '{path}' does not exist") from None
        except OSError as e:
            status = 400 if e.errno == errno.ENAMETOOLONG else 500
            raise HTTPFailure(status, f"error checking if path exists '{path}': {e}") from e
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            os.close(fd)
            raise HTTPFailure(400, f"path '{path}' is a directory")
    except HTTPFailure as f:
        return json_error(f.status, f.message)
    name = os.path.basename(path)
    headers = {"Vary": "Accept-Encoding"}
    conditional = "range" in request.headers or "if-range" in request.headers
    accept = request.headers.get("accept-encoding", "")
    accepted = _codings(accept)
    gzip_wanted = _wants_gzip(accepted)
    if _identity_refused(accepted) and (conditional or not gzip_wanted):
        what = "for Range or conditional request" if conditional else "found, supported: [gzip]"
        os.close(fd)
        return json_error(406, f"no acceptable encoding {what}")
    guessed = mimetypes.guess_type(name)[0] or "application/octet-stream"
    if not conditional and gzip_wanted:
        headers["Content-Disposition"] = f'inline; filename="{name}"'
        headers["Content-Encoding"] = "gzip"
        return StreamingResponse(_gzip_stream(open(fd, "rb")), media_type=guessed, headers=headers)
    if not conditional and st.st_size == 0:
        # procfs and sysfs files stat as empty yet have content: announced as empty, their
        # bytes would overrun the response. Sent chunked instead, until the read ends.
        headers["Content-Disposition"] = f'inline; filename="{name}"'
        return StreamingResponse(_until_eof(open(fd, "rb")), media_type=guessed, headers=headers)
    return _OpenFileResponse(
        fd, st, filename=name, content_disposition_type="inline", headers=headers
    )


@dataclass
class _Upload:
    """Destination files of one upload request, written as the body streams in."""

    user: User
    metadata: dict[str, str]
    max_bytes: int | None
    written: list[dict[str, object]] = field(default_factory=list)
    _fd: int | None = None
    _path: str | None = None
    _size: int = 0

    def open(self, path: str) -> None:
        if any(entry["path"] == path for entry in self.written):
            raise HTTPFailure(
                400,
                f"you cannot upload multiple files to the same path '{path}' in one upload request",
            )
        try:
            ensure_dirs(os.path.dirname(path), self.user)
            if os.path.isdir(path):
                raise HTTPFailure(400, f"path is a directory: {path}")
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
            os.fchown(self._fd, self.user.uid, self.user.gid)
        except OSError as e:
            raise _os_failure(e, f"error opening file '{path}'") from e
        self._path, self._size = path, 0

    def write(self, data: bytes) -> None:
        assert self._fd is not None
        self._size += len(data)
        if self.max_bytes is not None and self._size > self.max_bytes:
            raise HTTPFailure(413, f"file is larger than the {self.max_bytes} bytes allowed")
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            raise _os_failure(e, f"error writing file '{self._path}'") from e

    def close(self) -> None:
        fd, path = self._fd, self._path
        if fd is None or path is None:
            return
        self._fd = None
        try:
            write_metadata(path, self.metadata)
        except OSError as e:
            if e.errno != errno.ENOTSUP:
                raise _os_failure(e, "error writing file metadata") from e
        finally:
            os.close(fd)
        entry: dict[str, object] = {"name": os.path.basename(path), "type": "file", "path": path}
        if self.metadata:
            entry["metadata"] = read_metadata(path)
        self.written.append(entry)

    def abort(self) -> None:
        """End a failed upload: a file left half-written (e.g. over the size limit, or the
        client went away) is removed rather than left truncated."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if self._path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self._path)


def _os_failure(e: OSError, what: str) -> HTTPFailure:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return HTTPFailure(507, f"not enough disk space available: {what}: {e.strerror}")
    if e.errno == errno.ENOTDIR:
        return HTTPFailure(400, f"{what}: a parent path is a file")
    if e.errno in (errno.ENAMETOOLONG, errno.ELOOP):
        return HTTPFailure(400, f"{what}: {e.strerror}")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return HTTPFailure(403, f"{what}: {e.strerror}")
    return HTTPFailure(500, f"{what}: {e.strerror or e}")


async def _raw_body(request: Request) -> AsyncIterator[bytes]:
    """The request body as it arrives; records in `request.state` that reading began, so a
    rejected upload can be drained (see `_drain`)."""
    request.state.body_started = True
    async for chunk in request.stream():
        yield chunk


async def _body(request: Request) -> AsyncIterator[bytes]:
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        async for chunk in _raw_body(request):
            yield chunk
        return
    if encoding != "gzip":
        raise HTTPFailure(400, f"unsupported Content-Encoding: {encoding}, supported: [gzip]")
    decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        async for chunk in _raw_body(request):
            if out := decompressor.decompress(chunk):
                yield out
        if tail := decompressor.flush():
            yield tail
    except zlib.error as e:
        raise HTTPFailure(400, f"error decompressing request body: {e}") from e


# infra's limits: a key fits the VFS xattr-name limit after the `user.e2b.` prefix, and all of a
# file's metadata (keys with their prefix, plus values) fits one 4 KiB xattr block.
MAX_METADATA_KEY_BYTES = 246
MAX_METADATA_BYTES = 4096


def _metadata(request: Request) -> dict[str, str]:
    """`X-Metadata-<key>: <value>` headers as {key (lower-cased): value}; the first of repeated
    headers wins and an empty key is ignored, as in infra's envd."""
    metadata: dict[str, str] = {}
    for name, value in request.headers.items():
        if not name.startswith(METADATA_HEADER_PREFIX):
            continue
        key = name[len(METADATA_HEADER_PREFIX) :].lower()
        if not key or key in metadata:
            continue
        if not (key.isascii() and key.isprintable() and value.isascii() and value.isprintable()):
            raise HTTPFailure(
                400, f"invalid metadata: key and value must be printable ASCII ({name})"
            )
        if len(key) > MAX_METADATA_KEY_BYTES:
            raise HTTPFailure(
                400, f"invalid metadata: key longer than {MAX_METADATA_KEY_BYTES} bytes ({name})"
            )
        metadata[key] = value
    total = sum(len(METADATA_XATTR_PREFIX) + len(k) + len(v) for k, v in metadata.items())
    if total > MAX_METADATA_BYTES:
        raise HTTPFailure(
            400, f"invalid metadata: {total} bytes in total, at most {MAX_METADATA_BYTES} allowed"
        )
    return metadata


async def upload(request: Request, settings: Settings) -> Response:
    try:
        _authorize(request, settings, "write")
        user = _user(request, settings)
        upload = _Upload(user, _metadata(request), settings.max_upload_bytes)
        content_type, options = parse_options_header(request.headers.get("content-type", ""))
        query_path = request.query_params.get("path")
        try:
            if content_type == b"application/octet-stream":
                if not query_path:
                    raise HTTPFailure(400, "missing 'path' query parameter for octet-stream upload")
                length = request.headers.get("content-length")
                if (
                    upload.max_bytes is not None
                    and length
                    and length.isdigit()
                    and int(length) > upload.max_bytes
                ):
                    raise HTTPFailure(
                        413, f"file is larger than the {upload.max_bytes} bytes allowed"
                    )
                upload.open(_resolve(query_path, user, settings))
                async for chunk in _body(request):
                    upload.write(chunk)
                upload.close()
            elif content_type == b"multipart/form-data" and b"boundary" in options:
                await _multipart(request, options[b"boundary"], query_path, upload, settings)
            else:
                raise HTTPFailure(
                    400,
                    f"unsupported content type: {content_type.decode(errors='replace')}, "
                    "expected multipart/form-data or application/octet-stream",
                )
        finally:
            upload.abort()
    except HTTPFailure as f:
        await _drain(request)
        return json_error(f.status, f.message)
    if not upload.written:
        return json_error(400, "no file in the upload request")
    return JSONResponse(upload.written)


async def _drain(request: Request) -> None:
    """Read (and drop) what is left of a rejected upload, up to a bound, so the client gets to
    read our error instead of a connection reset while it is still sending."""
    # Starlette marks the stream consumed once the last body message has arrived (even if the
    # reader stopped early); there is no public flag for it.
    if getattr(request, "_stream_consumed", False):
        return
    if not getattr(request.state, "body_started", False):
        chunks = _raw_body(request)
    else:
        chunks = _rest_of_body(request)  # Starlette's stream() cannot be resumed
    drained = 0
    with contextlib.suppress(ClientDisconnect):
        async for chunk in chunks:
            drained += len(chunk)
            if drained > DRAIN_LIMIT:
                return


async def _rest_of_body(request: Request) -> AsyncIterator[bytes]:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


async def _multipart(
    request: Request, boundary: bytes, query_path: str | None, upload: _Upload, settings: Settings
) -> None:
    """Parse parts as they arrive; each `file` part streams into its destination."""
    headers: dict[bytes, bytes] = {}
    name: list[bytes] = []
    value: list[bytes] = []
    active = False

    def on_header_field(data: bytes, start: int, end: int) -> None:
        name.append(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        value.append(data[start:end])

    def on_header_end() -> None:
        headers[b"".join(name).lower()] = b"".join(value)
        name.clear()
        value.clear()

    def on_headers_finished() -> None:
        nonlocal active
        _, disposition = parse_options_header(headers.get(b"content-disposition", b""))
        headers.clear()
        active = disposition.get(b"name") == b"file"
        if not active:
            return
        # The SDK puts the full destination path in `filename`; `?path=` wins for one file.
        raw = query_path or disposition.get(b"filename", b"").decode()
        if not raw:
            raise HTTPFailure(400, "missing file path: no 'path' query parameter and no filename")
        upload.open(_resolve(raw, upload.user, settings))

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if active:
            upload.write(data[start:end])

    def on_part_end() -> None:
        nonlocal active
        if active:
            upload.close()
        active = False

    parser = MultipartParser(
        boundary,
        {
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    try:
        async for chunk in _body(request):
            parser.write(chunk)
        parser.finalize()
    except HTTPFailure:
        raise
    except Exception as e:  # the parser's own errors: a malformed body
        raise HTTPFailure(400, f"error parsing multipart form: {e}") from e
