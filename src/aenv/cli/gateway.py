"""`aenv gateway`: the E2B API and data-plane proxy in front of a cluster's nodes (see
docs/cluster.md). The cluster secret comes from the configuration file or `AENV_CLUSTER_SECRET`
only, never a flag (the process list would show it)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import typer

from aenv.cli.node import console
from aenv.config import ConfigError, load

app = typer.Typer(help="Run a cluster gateway.")


@app.callback(invoke_without_command=True)
def gateway(
    redis_url: Annotated[
        str | None, typer.Option(help="the cluster's Redis (AENV_REDIS_URL)")
    ] = None,
    port: Annotated[int | None, typer.Option(help="port for the API and the data plane")] = None,
    host: Annotated[str | None, typer.Option(help="address to listen on")] = None,
    home: Annotated[Path | None, typer.Option(help="data directory (its API keys)")] = None,
    domain: Annotated[str | None, typer.Option(help="sandbox hosts are <port>-<id>.DOMAIN")] = None,
) -> None:
    """Run one gateway; run any number behind a load balancer."""
    from aenv.cluster.registry import WrongClusterSecret
    from aenv.gateway.serve import GatewaySettings, run_gateway

    overrides = {"redis_url": redis_url, "port": port, "host": host, "home": home,
                 "domain": domain}  # fmt: skip
    try:
        config = load(overrides)
        settings = GatewaySettings.of(config)
    except ConfigError as e:
        console.print(f"[red]configuration error:[/red] {e}")
        raise typer.Exit(2) from e
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    console.print(f"[green]gateway serving[/green] {config.scheme}://{config.host}:{config.port}")
    try:
        asyncio.run(run_gateway(config, settings, progress=lambda m: console.print(m)))
    except WrongClusterSecret as e:
        console.print(f"[red]cannot join the cluster:[/red] {e}")
        raise typer.Exit(1) from e
