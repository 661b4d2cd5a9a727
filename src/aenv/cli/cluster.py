"""`aenv node`: a node that is a cluster member, the server of `aenv server` plus registration
and heartbeats in the cluster's Redis, and the internal API gateways call (see docs/cluster.md).

The cluster secret comes from the configuration file or `AENV_CLUSTER_SECRET` only: a command-line
flag would show it to every user of the host in the process list.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from starlette.types import ASGIApp

from aenv.cli import nodes
from aenv.cli.node import console
from aenv.config import ConfigError, load

if TYPE_CHECKING:
    from aenv.cluster.drain import DrainMemory
    from aenv.cluster.membership import NodeSettings
    from aenv.server import Node

app = typer.Typer(help="Run a cluster node, or drain one.")
app.command()(nodes.drain)
app.command()(nodes.undrain)
app.command()(nodes.events)


@app.callback(invoke_without_command=True)
def node(
    ctx: typer.Context,
    redis_url: Annotated[
        str | None, typer.Option(help="the cluster's Redis (AENV_REDIS_URL)")
    ] = None,
    node_id: Annotated[str | None, typer.Option(help="this node's id (default: host name)")] = None,
    node_address: Annotated[
        str | None, typer.Option(help="host:port gateways reach this node at")
    ] = None,
    port: Annotated[int | None, typer.Option(help="port for the API and the data plane")] = None,
    host: Annotated[str | None, typer.Option(help="address to listen on")] = None,
    home: Annotated[Path | None, typer.Option(help="data directory (AENV_HOME)")] = None,
    driver: Annotated[str | None, typer.Option(help="auto|firecracker|qemu-kvm|qemu-tcg")] = None,
) -> None:
    """Run one node as a member of a cluster."""
    if ctx.invoked_subcommand is not None:
        return
    from aenv.cluster.membership import NodeSettings

    overrides = {
        "redis_url": redis_url, "node_id": node_id, "node_address": node_address,
        "port": port, "host": host, "home": home, "driver": driver,
    }  # fmt: skip
    try:
        config = load(overrides)
        settings = NodeSettings.of(config)
    except ConfigError as e:
        console.print(f"[red]configuration error:[/red] {e}")
        raise typer.Exit(2) from e
    from aenv.cluster.registry import NodeIdTaken, WrongClusterSecret

    console.print(
        f"[cyan]aenv[/cyan] node {settings.node_id} joins the cluster at {settings.address}"
    )
    from aenv.cli.serve import serve
    from aenv.cluster.drain import DrainMemory
    from aenv.cluster.internal import InternalGate

    # One memory of the drain: the agent keeps it, the internal API refuses creates by it.
    drain = DrainMemory(settings.drain_file)

    def gate(app: ASGIApp) -> ASGIApp:
        return InternalGate(app, settings.secret, lambda: drain.state.draining)

    def member(running: Node) -> AbstractAsyncContextManager[None]:
        return _member(settings, running, drain)

    try:
        asyncio.run(serve(config, beside=member, gate=gate))
    except (NodeIdTaken, WrongClusterSecret) as e:
        # The node has shut down again (its sandboxes paused or killed, as configured).
        console.print(f"[red]cannot join the cluster:[/red] {e}")
        raise typer.Exit(1) from e
    except ConfigError as e:  # what the host cannot do, found as the node starts
        console.print(f"[red]configuration error:[/red] {e}")
        raise typer.Exit(2) from e


@asynccontextmanager
async def _member(settings: NodeSettings, running: Node, drain: DrainMemory) -> AsyncIterator[None]:
    from aenv.cluster.membership import membership
    from aenv.cluster.peers import ClusterPeers
    from aenv.cluster.source import CatalogSource

    orchestrator = running.orchestrator
    source = CatalogSource(
        running.catalog,
        orchestrator.templates,
        orchestrator.forget,
        running.builder,
        orchestrator.webhooks,
        orchestrator.secrets,
    )
    async with membership(settings, source, drain) as agent:
        running.orchestrator.residency.append(agent)
        # Pulls read the chunks other nodes hold before the shared repository's store.
        archive = running.orchestrator.saved.archive
        peers = ClusterPeers(agent.registry, settings.node_id, settings.secret)
        if archive is not None:
            archive.use_peers(peers)
        try:
            yield
        finally:
            if archive is not None:
                archive.use_peers(None)
            running.orchestrator.residency.remove(agent)
