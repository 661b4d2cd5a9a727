"""The `aenv` command: `server` runs a node, `auth` prints how to reach it; `node` (cluster.py)
runs one as a cluster member, `gateway` (gateway.py) a cluster's gateway; the other commands
(sandboxes.py, snapshots.py, templates.py, shell.py) talk to a running node."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import uvicorn
from starlette.types import ASGIApp

from aenv.cli import (
    cluster,
    doctor,
    gateway,
    images,
    keys,
    nodes,
    sandboxes,
    shell,
    snapshots,
    templates,
    volumes,
)
from aenv.cli.node import console
from aenv.config import Config, ConfigError, load

if TYPE_CHECKING:
    from aenv.server import Node

# What runs beside a serving node for as long as it serves (a cluster membership).
Beside = Callable[["Node"], AbstractAsyncContextManager[object]]
# What wraps the node's app before it is served (a cluster node's internal API gate).
Gate = Callable[[ASGIApp], ASGIApp]

app = typer.Typer(help="AENV-py: E2B-compatible microVM sandboxes.", no_args_is_help=True)
app.add_typer(images.app)
app.add_typer(sandboxes.app)
app.add_typer(snapshots.app)
app.add_typer(shell.app)
app.add_typer(templates.app, name="template")
app.add_typer(keys.app, name="keys")
app.add_typer(volumes.app, name="volumes")
app.add_typer(cluster.app, name="node")
app.add_typer(gateway.app, name="gateway")
app.add_typer(nodes.app, name="nodes")
app.command()(doctor.doctor)


@app.command()
def server(
    port: Annotated[int | None, typer.Option(help="port for the API and the data plane")] = None,
    host: Annotated[str | None, typer.Option(help="address to listen on")] = None,
    home: Annotated[Path | None, typer.Option(help="data directory (AENV_HOME)")] = None,
    driver: Annotated[str | None, typer.Option(help="auto|firecracker|qemu-kvm|qemu-tcg")] = None,
    domain: Annotated[
        str | None, typer.Option(help="sandbox hosts are <port>-<id>.DOMAIN, the API api.DOMAIN")
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option(help="serve HTTPS with this certificate (for *.DOMAIN)")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="the certificate's private key")] = None,
) -> None:
    """Run one node: control plane and data plane on one port."""
    overrides = {"port": port, "host": host, "home": home, "driver": driver, "domain": domain}
    try:
        config = load({**overrides, "tls_cert": tls_cert, "tls_key": tls_key})
    except ConfigError as e:
        console.print(f"[red]configuration error:[/red] {e}")
        raise typer.Exit(2) from e
    try:
        asyncio.run(serve(config))
    except ConfigError as e:  # what the host cannot do, found as the node starts
        console.print(f"[red]configuration error:[/red] {e}")
        raise typer.Exit(2) from e


async def serve(config: Config, beside: Beside | None = None, gate: Gate | None = None) -> None:
    """Runs a node until SIGINT or SIGTERM, with `beside` entered while it serves and its app
    behind `gate`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per envd call is noise
    # The server's imports are heavy; other commands skip them.
    from aenv.publish import Publication
    from aenv.server import start_node
    from aenv.serving import uvicorn_config

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
    if config.publish_code_interpreter:
        publication = Publication.reserve(config, node.orchestrator.templates, node.builder)
        if publication is not None:
            publishing = asyncio.create_task(publication.run(lambda: uv.started))
    try:
        async with beside(node) if beside else nullcontext():
            await uv.serve()
    finally:
        if publishing is not None:
            publishing.cancel()
        action = "pausing" if config.pause_on_shutdown else "killing"
        console.print(f"[cyan]aenv[/cyan] shutting down: {action} running sandboxes...")
        await node.close()


@app.command()
def auth(home: Annotated[Path | None, typer.Option(help="data directory")] = None) -> None:
    """Print where the node's API key is and the environment to point E2B SDKs here."""
    config = load({"home": home})
    key_file = config.paths.api_key
    key = key_file.read_text().strip() if key_file.exists() else None
    if key is None:
        console.print(f"no API key yet: start the server once ({key_file})")
        raise typer.Exit(1)
    if config.domain and config.tls_cert:
        # The SDKs' own scheme: https://api.<domain> and https://<port>-<id>.<domain>.
        typer.echo(f"export E2B_API_KEY={key}\nexport E2B_DOMAIN={config.domain}")
        return
    base = f"{config.scheme}://localhost:{config.port}"
    # Without E2B_DOMAIN the SDKs name E2B's cloud in `get_host(port)` and send volume file
    # calls there: `localhost` names (routed by the node whatever its domain) stay on this host.
    typer.echo(
        f"export E2B_API_KEY={key}\nexport E2B_API_URL={base}\nexport E2B_SANDBOX_URL={base}\n"
        f"export E2B_VOLUME_API_URL={base}\nexport E2B_DOMAIN=localhost:{config.port}"
    )


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    app()
