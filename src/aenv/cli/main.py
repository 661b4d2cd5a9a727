"""`aenv` commands. `server` runs a node; more commands talk to a running one over its API."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import uvicorn
from rich.console import Console
from rich.table import Table

from aenv.config import Config, ConfigError, load

app = typer.Typer(help="AENV-py: E2B-compatible microVM sandboxes.", no_args_is_help=True)
console = Console(stderr=True)


@app.command()
def server(
    port: Annotated[int | None, typer.Option(help="port for the API and the data plane")] = None,
    host: Annotated[str | None, typer.Option(help="address to listen on")] = None,
    home: Annotated[Path | None, typer.Option(help="data directory (AENV_HOME)")] = None,
    driver: Annotated[str | None, typer.Option(help="auto|firecracker|qemu-kvm|qemu-tcg")] = None,
) -> None:
    """Run one node: control plane and data plane on one port."""
    try:
        config = load({"port": port, "host": host, "home": home, "driver": driver})
    except ConfigError as e:
        console.print(f"[red]configuration error:[/red] {e}")
        raise typer.Exit(2) from e
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per envd call is noise
    asyncio.run(_serve(config))


async def _serve(config: Config) -> None:
    from aenv.server import start_node  # the server's imports are heavy; other commands skip them

    node = await start_node(config, progress=lambda m: console.print(f"[cyan]aenv[/cyan] {m}"))
    uv = uvicorn.Server(
        uvicorn.Config(
            node.app,
            host=config.host,
            port=config.port,
            loop="uvloop",
            http="httptools",
            lifespan="off",
            access_log=False,
            log_level="warning",
            # Proxied responses carry the sandbox's own Server header.
            server_header=False,
            timeout_keep_alive=650,
        )
    )
    # Let uvicorn own SIGINT/SIGTERM, then shut the node down after it stops serving.
    console.print(f"[green]serving[/green] http://{config.host}:{config.port}")
    try:
        await uv.serve()
    finally:
        await node.close()


@app.command()
def auth(home: Annotated[Path | None, typer.Option(help="data directory")] = None) -> None:
    """Print where the node's API key is and the environment to point E2B SDKs here."""
    config = load({"home": home})
    key = config.api_key_path.read_text().strip() if config.api_key_path.exists() else None
    if key is None:
        console.print(f"no API key yet: start the server once ({config.api_key_path})")
        raise typer.Exit(1)
    base = f"http://localhost:{config.port}"
    typer.echo(
        f"export E2B_API_KEY={key}\nexport E2B_API_URL={base}\nexport E2B_SANDBOX_URL={base}"
    )


# -- commands that talk to a running node ------------------------------------------------------

JsonOption = Annotated[bool, typer.Option("--json", help="machine-readable output")]
HomeOption = Annotated[Path | None, typer.Option(help="data directory (for the API key)")]


def _client(home: Path | None) -> httpx.Client:
    """A client for the local node: `E2B_API_URL`/`E2B_API_KEY` when set, else this node's."""
    config = load({"home": home})
    key = os.environ.get("E2B_API_KEY")
    if key is None and config.api_key_path.exists():
        key = config.api_key_path.read_text().strip()
    if key is None:
        console.print("no API key: set E2B_API_KEY or start the server once")
        raise typer.Exit(1)
    base = os.environ.get("E2B_API_URL", f"http://localhost:{config.port}")
    return httpx.Client(base_url=base, headers={"X-API-KEY": key}, timeout=60)


def _call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    try:
        response = client.request(method, path, **kwargs)
    except httpx.TransportError as e:
        console.print(f"[red]cannot reach the node at {client.base_url}:[/red] {e}")
        raise typer.Exit(1) from e
    if response.status_code >= 400:
        try:
            message = response.json().get("message", response.text)
        except ValueError:
            message = response.text
        console.print(f"[red]{response.status_code}:[/red] {message}")
        raise typer.Exit(1)
    return response


@app.command("ls")
def list_sandboxes(json_out: JsonOption = False, home: HomeOption = None) -> None:
    """List running and paused sandboxes."""
    with _client(home) as client:
        sandboxes = _call(client, "GET", "/v2/sandboxes", params={"limit": 100}).json()
    if json_out:
        typer.echo(json.dumps(sandboxes, indent=2))
        return
    table = Table("ID", "TEMPLATE", "STATE", "STARTED", "ENDS", "METADATA")
    for s in sandboxes:
        meta = ",".join(f"{k}={v}" for k, v in (s.get("metadata") or {}).items())
        table.add_row(
            s["sandboxID"], s.get("alias") or s["templateID"], s["state"], s["startedAt"],
            s["endAt"], meta,
        )  # fmt: skip
    Console().print(table)


@app.command()
def info(sandbox_id: str, json_out: JsonOption = False, home: HomeOption = None) -> None:
    """Show one sandbox."""
    with _client(home) as client:
        detail = _call(client, "GET", f"/sandboxes/{sandbox_id}").json()
    detail.pop("envdAccessToken", None)  # a secret: not for terminals and logs
    if json_out:
        typer.echo(json.dumps(detail, indent=2))
        return
    for key, value in detail.items():
        typer.echo(f"{key:20} {value}")


@app.command()
def timeout(sandbox_id: str, seconds: int, home: HomeOption = None) -> None:
    """Set a sandbox to end SECONDS from now."""
    with _client(home) as client:
        _call(client, "POST", f"/sandboxes/{sandbox_id}/timeout", json={"timeout": seconds})


@app.command()
def rm(sandbox_ids: list[str], home: HomeOption = None) -> None:
    """Kill sandboxes."""
    with _client(home) as client:
        for sandbox_id in sandbox_ids:
            _call(client, "DELETE", f"/sandboxes/{sandbox_id}")
            typer.echo(sandbox_id)


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    app()
