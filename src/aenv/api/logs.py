"""Sandbox log routes of the E2B control plane (`GET /sandboxes/{id}/logs`, v1 and v2), served
from the guest serial console of the sandbox's VMs.

The console output carries no time per line. A line is stamped with its console file's last
modification time when this server first reads it: an upper bound on when the guest wrote it,
close for clients that poll (`aenv logs --follow`), and fixed from then on, so `start`/`cursor`
select the same lines on every request. Lines already present at the first read share one stamp.
Stamps live in this process only, as the sandboxes themselves do. Every line is level `info`:
the console has no levels either.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, not_found
from aenv.api.sandboxes import rfc3339
from aenv.orchestrator.lifecycle import Orchestrator, SandboxNotFound

DEFAULT_LIMIT = 1000
MAX_LIMIT_V2 = 1000
MAX_SEARCH = 256
LEVELS = ("debug", "info", "warn", "error")  # lowest first, as the spec's LogLevel


@dataclass(frozen=True)
class LogLine:
    ms: int  # unix milliseconds
    text: str


@dataclass
class _Stamps:
    """When the lines of one console file were first read: runs of `(unix ms, line count)`."""

    runs: list[tuple[int, int]] = field(default_factory=list)
    lines: int = 0


_File = tuple[Path, list[str], int]  # a console file, its complete lines, its mtime (unix ms)


def _read(paths: list[Path], known: list[Path]) -> tuple[list[_File], set[Path]]:
    """Each file's complete lines and its mtime (taken after the read, so it covers every line
    read), and which of the `known` files are gone."""
    files: list[_File] = []
    for path in paths:
        try:
            raw = path.read_bytes()
            mtime_ms = path.stat().st_mtime_ns // 1_000_000
        except FileNotFoundError:
            continue  # the sandbox went away meanwhile
        # The piece after the last newline is a line still being written: it shows once complete.
        files.append((path, raw.decode(errors="replace").split("\n")[:-1], mtime_ms))
    return files, {p for p in known if not p.exists()}


class ConsoleLog:
    """Console lines of sandboxes with their stamps (see the module docstring)."""

    def __init__(self) -> None:
        self._stamps: dict[Path, _Stamps] = {}

    async def lines(self, paths: list[Path]) -> list[LogLine]:
        """Non-blank lines of `paths` (oldest file first), oldest first."""
        files, gone = await asyncio.to_thread(_read, paths, list(self._stamps))
        for path in gone:  # files of killed sandboxes
            self._stamps.pop(path, None)
        out: list[LogLine] = []
        for path, lines, mtime_ms in files:
            seen = self._stamps.setdefault(path, _Stamps())
            if len(lines) > seen.lines:
                # Never before an earlier run, even if the clock stepped back: stamps stay ordered.
                ms = max(mtime_ms, seen.runs[-1][0]) if seen.runs else mtime_ms
                seen.runs.append((ms, len(lines) - seen.lines))
                seen.lines = len(lines)
            stamps = itertools.chain.from_iterable(itertools.repeat(ms, n) for ms, n in seen.runs)
            # Console files only grow; were one cut short, its remaining lines keep their stamps.
            pairs = zip(stamps, lines, strict=False)
            out.extend(LogLine(ms, text.rstrip()) for ms, text in pairs if text.strip())
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
