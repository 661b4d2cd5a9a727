"""`aenv keys list|create|rename|revoke`: the API keys of the caller's team, over E2B's
`/api-keys` routes; `aenv keys create --team` makes a key of any team, over E2B's admin route,
with the node's admin token."""

from __future__ import annotations

import json
from typing import Annotated
from urllib.parse import quote

import typer
from rich.console import Console
from rich.table import Table

from aenv.cli.node import HomeOption, JsonOption, admin, call, node
from aenv.cli.teams import team_id_of

app = typer.Typer(help="The node's API keys.", no_args_is_help=True)


def _mask(key: dict[str, object]) -> str:
    mask = key["mask"]
    assert isinstance(mask, dict)
    return f"{mask['prefix']}{mask['maskedValuePrefix']}…{mask['maskedValueSuffix']}"


@app.command("list")
def list_keys(json_out: JsonOption = False, home: HomeOption = None) -> None:
    """List the keys (masked: a key's value is shown only when it is created)."""
    with node(home).client() as client:
        keys = call(client, "GET", "/api-keys").json()
    if json_out:
        typer.echo(json.dumps(keys, indent=2))
        return
    table = Table("ID", "NAME", "KEY", "CREATED", "LAST USED")
    for key in keys:
        table.add_row(key["id"], key["name"], _mask(key), key["createdAt"], key["lastUsed"] or "")
    Console().print(table)


@app.command()
def create(
    name: str,
    team: Annotated[
        str | None,
        typer.Option(help="the team (id or name) the key acts for; needs the admin token"),
    ] = None,
    json_out: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """Create a key named NAME and print its value (stored hashed: shown this once)."""
    if team is None:
        with node(home).client() as client:
            key = call(client, "POST", "/api-keys", json={"name": name}).json()
    else:
        with admin(home) as client:
            team_id = team_id_of(client, team)
            path = f"/admin/teams/{quote(team_id)}/api-keys"
            key = call(client, "POST", path, json={"name": name}).json()
    typer.echo(json.dumps(key, indent=2) if json_out else key["key"])


@app.command()
def rename(key_id: str, name: str, home: HomeOption = None) -> None:
    """Give key KEY_ID the name NAME."""
    with node(home).client() as client:
        call(client, "PATCH", f"/api-keys/{quote(key_id)}", json={"name": name})


@app.command()
def revoke(key_ids: list[str], home: HomeOption = None) -> None:
    """Revoke keys: requests with them are refused from now on."""
    with node(home).client() as client:
        for key_id in key_ids:
            call(client, "DELETE", f"/api-keys/{quote(key_id)}")
