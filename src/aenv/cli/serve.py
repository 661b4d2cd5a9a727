"""Serving a node from the command line, for `aenv server` and `aenv node`: start it, serve its
app until SIGINT or SIGTERM, then shut it down."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import TYPE_CHECKING

import uvicorn
from starlette.types import ASGIApp

from aenv.cli.node import console
from aenv.config import Config

if TYPE_CHECKING:
    from aenv.server import Node

# What runs beside a serving node for as long as it serves (a cluster membership).
Beside = Callable[["Node"], AbstractAsyncContextManager[object]]
# What wraps the node's app before it is served (a cluster node's internal API gate).
Gate = Callable[[ASGIApp], ASGIApp]


async def serve(config: Config, beside: Beside | None = None, gate: Gate | None = None) -> None:
    """Runs a node until SIGINT or SIGTERM, with `beside` entered while it serves and its app
    behind `gate`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per envd call is noise
    # The server's imports are heavy; other commands skip them.
    from aenv.publish import Publication, Published
    from aenv.server import start_node
    from aenv.serving import uvicorn_config

    # A bad definition is a configuration error, found before the node makes anything.
    published = Published.read(config) if config.publish_code_interpreter else None
    node = await start_node(config, progress=lambda m: console.print(f"[cyan]aenv[/cyan] {m}"))
    app: ASGIApp = node.app if gate is None else gate(node.app)
    uv = uvicorn.Server(uvicorn_config(app, config))
    # uvicorn owns SIGINT/SIGTERM while it serves, and afterwards re-raises the signal it caught
    # to whatever handler was there before: make that a no-op, or the default handler would end
    # the process before the node's shutdown (which pauses the running sandboxes) has run.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    console.print(f"[green]serving[/green] {config.scheme}://{config.host}:{config.port}")
    publishing = None
    try:
        if published is not None:
            templates = node.orchestrator.templates
            publication = Publication.reserve(config, published, templates, node.builder)
            if publication is not None:
                publishing = asyncio.create_task(publication.run(lambda: uv.started))
        async with beside(node) if beside else nullcontext():
            await uv.serve()
    finally:
        if publishing is not None:
            publishing.cancel()
        action = "pausing" if config.pause_on_shutdown else "killing"
        console.print(f"[cyan]aenv[/cyan] shutting down: {action} running sandboxes...")
        await node.close()
