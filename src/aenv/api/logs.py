"""Sandbox log routes of the E2B control plane (`GET /sandboxes/{id}/logs`, v1 and v2), served
from the guest serial console of the sandbox's VMs.

The console output carries no time per line. A line is stamped with its console file's last
modification time when this server first reads it: an upper bound on when the guest wrote it,
close for clients that poll (`aenv logs --follow`), and fixed from then on, so `start`/`cursor`
select the same lines on every request. Lines already present at the first read share one stamp.
Stamps live in this process only, as the sandboxes themselves do. Every line is level `info`:
the console has no levels either. A request reads at most `READ_LIMIT` bytes from the end of
each console file, in a thread: what a guest writes is bounded (`orchestrator.consoles`), but a
request must cost neither the event loop nor memory in proportion to it.
"""

from __future__ import annotations

import asyncio
import bisect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, not_found
from aenv.api.requests import check_query
from aenv.api.sandboxes import rfc3339
from aenv.orchestrator.lifecycle import Orchestrator, SandboxNotFound

DEFAULT_LIMIT = 1000
MAX_LIMIT_V2 = 1000
MAX_SEARCH = 256
# Bytes read from the end of each console file per request.
READ_LIMIT = 1 << 20
LEVELS = ("debug", "info", "warn", "error")  # lowest first, as the spec's LogLevel


@dataclass(frozen=True)
class LogLine:
    ms: int  # unix milliseconds
    text: str


@dataclass
class _Stamps:
    """When the bytes of one console file were first read: runs of `(unix ms, end offset)`,
    oldest first; a line takes the stamp of the first run that reaches its end."""

    inode: int
    runs: list[tuple[int, int]] = field(default_factory=list)
    end: int = 0  # bytes stamped so far


@dataclass(frozen=True)
class _Tail:
    """The complete lines at the end of a console file, each with its end offset."""

    path: Path
    inode: int
    mtime_ms: int
    lines: list[tuple[int, str]]
    end: int  # offset after the last complete line
    start: int  # offset of the first byte read


def _read_tail(path: Path, limit: int) -> _Tail | None:
    """At most the last `limit` bytes of `path`, cut into complete lines; None when it is gone.
    The mtime is taken after the read, so it covers every line read."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = max(0, size - limit)
            f.seek(start)
            raw = f.read(size - start)
            st = os.fstat(f.fileno())
    except FileNotFoundError:
        return None  # the sandbox went away meanwhile
    offset = start
    pieces = raw.split(b"\n")
    if start > 0:
        offset += len(pieces[0]) + 1  # the first line began before the bytes read
        pieces = pieces[1:]
    lines = []
    # The piece after the last newline is a line still being written: it shows once complete.
    for piece in pieces[:-1]:
        offset += len(piece) + 1
        lines.append((offset, piece.decode(errors="replace")))
    end = offset if lines else start
    return _Tail(path, st.st_ino, st.st_mtime_ns // 1_000_000, lines, end, start)


def _read(paths: list[Path], known: list[Path], limit: int) -> tuple[list[_Tail], set[Path]]:
    tails = [t for t in (_read_tail(p, limit) for p in paths) if t is not None]
    return tails, {p for p in known if not p.exists()}


class ConsoleLog:
    """Console lines of sandboxes with their stamps (see the module docstring). Only the last
    `read_limit` bytes of each console file are read: a guest writing without pause makes its
    file grow up to its cap (see `orchestrator.consoles`), and a request must not read all of
    it."""

    def __init__(self, read_limit: int = READ_LIMIT) -> None:
        self.read_limit = read_limit
        self._stamps: dict[Path, _Stamps] = {}

    async def lines(self, paths: list[Path]) -> list[LogLine]:
        """Non-blank lines of the ends of `paths` (oldest file first), oldest first."""
        tails, gone = await asyncio.to_thread(_read, paths, list(self._stamps), self.read_limit)
        for path in gone:  # files of killed sandboxes
            self._stamps.pop(path, None)
        out: list[LogLine] = []
        for tail in tails:
            seen = self._stamps.get(tail.path)
            if seen is None or seen.inode != tail.inode or tail.end < seen.end:
                # New, or replaced or cut short by the cap: its lines are new to us.
                seen = self._stamps[tail.path] = _Stamps(tail.inode)
            if tail.end > seen.end:
                # Never before an earlier run, even if the clock stepped back: stamps stay ordered.
                ms = max(tail.mtime_ms, seen.runs[-1][0]) if seen.runs else tail.mtime_ms
                seen.runs.append((ms, tail.end))
                seen.end = tail.end
            # Runs that end before the bytes read can never stamp a line again.
            while len(seen.runs) > 1 and seen.runs[0][1] <= tail.start:
                seen.runs.pop(0)
            ends = [end for _, end in seen.runs]
            for end, text in tail.lines:
                if text.strip():
                    ms = seen.runs[bisect.bisect_left(ends, end)][0]
                    out.append(LogLine(ms, text.rstrip()))
        out.sort(key=lambda line: line.ms)  # stable: files and lines keep their order
        return out


class LogRoutes:
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orc = orchestrator
        self.console = ConsoleLog()

    def routes(self) -> list[Route]:
        return [
            Route("/sandboxes/{sandbox_id}/logs", self.logs_v1, methods=["GET"]),
            Route("/v2/sandboxes/{sandbox_id}/logs", self.logs_v2, methods=["GET"]),
        ]

    async def _lines(self, request: Request) -> list[LogLine]:
        sandbox_id = request.path_params["sandbox_id"]
        try:
            paths = self.orc.console_logs(sandbox_id)
        except SandboxNotFound as e:
            raise not_found(f"sandbox '{sandbox_id}'") from e
        return await self.console.lines(paths)

    async def logs_v1(self, request: Request) -> Response:
        """`SandboxLogs`: lines from `start` (unix ms) on, oldest first."""
        check_query(request, {"start", "limit"})
        q = request.query_params
        start = _int_param(q.get("start"), "start")
        limit = _limit(q.get("limit"))
        lines = await self._lines(request)
        page = [line for line in lines if start is None or line.ms >= start][:limit]
        entries = [_entry(line) for line in page]
        plain = [{"timestamp": e["timestamp"], "line": e["message"]} for e in entries]
        return JSONResponse({"logs": plain, "logEntries": entries})

    async def logs_v2(self, request: Request) -> Response:
        """`SandboxLogsV2Response`: `forward` from `cursor` (unix ms) oldest first, or `backward`
        from it newest first; `level` is a minimum, `search` a case-sensitive substring."""
        check_query(request, {"cursor", "limit", "direction", "level", "search"})
        q = request.query_params
        cursor = _int_param(q.get("cursor"), "cursor")
        limit = _limit(q.get("limit"))
        if limit > MAX_LIMIT_V2:
            raise APIError(400, f"limit must be at most {MAX_LIMIT_V2}")
        direction = q.get("direction", "forward")
        if direction not in ("forward", "backward"):
            raise APIError(400, "direction must be 'forward' or 'backward'")
        level = q.get("level", "debug")
        if level not in LEVELS:
            raise APIError(400, f"level must be one of {', '.join(LEVELS)}")
        search = q.get("search", "")
        if len(search) > MAX_SEARCH:
            raise APIError(400, f"search must be at most {MAX_SEARCH} characters")
        lines = await self._lines(request)
        if LEVELS.index(level) > LEVELS.index("info"):
            lines = []
        lines = [line for line in lines if search in line.text]
        if direction == "forward":
            lines = [line for line in lines if cursor is None or line.ms >= cursor]
        else:
            lines = [line for line in reversed(lines) if cursor is None or line.ms <= cursor]
        return JSONResponse({"logs": [_entry(line) for line in lines[:limit]]})


def _entry(line: LogLine) -> dict[str, Any]:
    return {
        "timestamp": rfc3339(line.ms / 1000),
        "level": "info",
        "message": line.text,
        "fields": {},
    }


def _int_param(value: str | None, name: str) -> int | None:
    """A non-negative integer query parameter (None when absent)."""
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError as e:
        raise APIError(400, f"{name} must be an integer") from e
    if number < 0:
        raise APIError(400, f"{name} must not be negative")
    return number


def _limit(value: str | None) -> int:
    limit = _int_param(value, "limit")
    return DEFAULT_LIMIT if limit is None else limit
