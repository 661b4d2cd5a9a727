"""Run a build command as an asyncio subprocess and fail with its stderr."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aenv.subprocesses import tied


class BuildError(RuntimeError):
    """A guest build step failed."""


async def run(*argv: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    proc = await asyncio.create_subprocess_exec(
        *tied(argv),
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip()[-2000:]
        raise BuildError(f"{argv[0]} exited with {proc.returncode}: {tail}")
    return out.decode(errors="replace")
