"""`aenv-envd`: run envd (as root inside the guest) on port 49983."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
from types import FrameType

import uvicorn

from aenv.envd import ENVD_PORT
from aenv.envd.app import create_app
from aenv.envd.settings import Settings


def _protect_from_oom() -> None:
    # The OOM killer should pick the user's processes, not the daemon that serves the sandbox.
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write("-1000")


def _raise_fd_limit() -> None:
    # Every running command holds a few fds (pipes or a PTY, a pidfd, its stream's socket); a
    # guest init's default soft limit of 1024 would cap concurrent commands at ~200. Go (infra's
    # envd) raises its soft limit to the hard one at startup; do the same.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class _QuietServer(uvicorn.Server):
    """uvicorn's main loop wakes ten times a second (to refresh the Date header and look for a
    shutdown request). In a guest that was most of an idle sandbox's CPU: under emulation every
    wakeup runs Python on an emulated CPU, and a node holds hundreds of idle sandboxes. envd
    sends no Date header and sleeps until a signal asks it to stop."""

    _stop: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if not await self.on_tick(0):  # the static default headers, once
            await self._stop.wait()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="aenv-envd", description=__doc__)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")  # noqa: S104
    p.add_argument("--port", type=int, default=ENVD_PORT)
    p.add_argument("--access-token", default=os.environ.get("AENV_ENVD_ACCESS_TOKEN"))
    p.add_argument("--default-user", default=None, help="user for requests that name none")
    p.add_argument("--default-workdir", default=None)
    p.add_argument("--max-upload-bytes", type=int, default=None)
    p.add_argument(
        "--process-retention",
        type=float,
        default=30.0,
        help="seconds an exited process stays connectable",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = Settings(
        access_token=args.access_token or None,
        default_workdir=args.default_workdir,
        max_upload_bytes=args.max_upload_bytes,
        process_retention=args.process_retention,
    )
    if args.default_user:
        settings.default_user = args.default_user
    _raise_fd_limit()
    if os.geteuid() == 0:
        _protect_from_oom()
    config = uvicorn.Config(
        create_app(settings),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        date_header=False,
        # The SDKs keep idle connections for up to 300 s; never close one they may reuse.
        timeout_keep_alive=650,
    )
    _QuietServer(config).run()


if __name__ == "__main__":
    main()
