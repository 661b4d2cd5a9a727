"""`aenv volumes list|create|delete`: the node's volumes, over E2B's `/volumes` routes."""

from __future__ import annotations

import json
from typing import Annotated
from urllib.parse import quote

import typer
from rich.console import Console
from rich.table import Table

from aenv.cli.node import HomeOption, JsonOption, call, node

app = typer.Typer(
    help="The node's volumes (shared directories sandboxes mount).", no_args_is_help=True
)


@app.command("list")
def list_volumes(json_out: JsonOption = False, home: HomeOption = None) -> None:
    """List the volumes."""
    with node(home).client() as client:
        volumes = call(client, "GET", "/volumes").json()
    if json_out:
        typer.echo(json.dumps(volumes, indent=2))
        return
    table = Table("ID", "NAME")
    for volume in volumes:
        table.add_row(volume["volumeID"], volume["name"])
    Console().print(table)


@app.command()
def create(
    name: str,
    size_mb: Annotated[
        int | None, typer.Option("--size-mb", help="Its size (MiB); the node's default if unset.")
    ] = None,
    json_out: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """Create a volume named NAME and print its id."""
    body: dict[str, object] = {"name": name}
    if size_mb is not None:
        body["sizeMB"] = size_mb
    with node(home).client() as client:
        volume = call(client, "POST", "/volumes", json=body).json()
    typer.echo(json.dumps(volume, indent=2) if json_out else volume["volumeID"])


@app.command()
def delete(volume_ids: list[str], home: HomeOption = None) -> None:
    """Delete volumes and their files (refused for a volume a sandbox mounts)."""
    with node(home).client() as client:
        for volume_id in volume_ids:
            call(client, "DELETE", f"/volumes/{quote(volume_id)}")
            typer.echo(volume_id)
