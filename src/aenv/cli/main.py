"""The `aenv` command: `server` runs a node (serve.py), `auth` prints how to reach it; `node`
(cluster.py) runs one as a cluster member, `gateway` (gateway.py) a cluster's gateway; the other
commands (sandboxes.py, snapshots.py, templates.py, shell.py) talk to a running node."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Annotated

import typer

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
    teams,
    templates,
    volumes,
)
from aenv.cli.node import console
from aenv.config import ConfigError, load

app = typer.Typer(help="AENV-py: E2B-compatible microVM sandboxes.", no_args_is_help=True)
app.add_typer(images.app)
app.add_typer(sandboxes.app)
app.add_typer(snapshots.app)
app.add_typer(shell.app)
app.add_typer(templates.app, name="template")
app.add_typer(keys.app, name="keys")
app.add_typer(teams.app, name="teams")
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
    # Imported here: the server is most of aenv, and every other command (and --help) runs
    # without it.
    from aenv.cli.serve import serve

    try:
        asyncio.run(serve(config))
    except ConfigError as e:  # what the host cannot do, found as the node starts
        console.print(f"[red]configuration error:[/red] {e}")
        raise typer.Exit(2) from e


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
