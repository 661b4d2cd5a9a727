"""`aenv teams list|create|delete`: the node's teams, over its operator routes (`api.admin`),
with the node's admin token; a cluster's, over a gateway's (`aenv.gateway.admin`), with the
cluster's. A team's keys are made with `aenv keys create --team`."""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
import typer
from rich.console import Console
from rich.table import Table

from aenv.api.extensions import ADMIN_TEAMS
from aenv.cli.node import HomeOption, JsonOption, admin, call, fail

app = typer.Typer(
    help="The teams of a node or a cluster (needs its admin token).", no_args_is_help=True
)


def team_id_of(client: httpx.Client, team: str) -> str:
    """The id of the team `team` names (its id or its name)."""
    for found in call(client, "GET", ADMIN_TEAMS).json():
        if team in (found["teamID"], found["name"]):
            return str(found["teamID"])
    fail(f"no team '{team}'")


@app.command("list")
def list_teams(json_out: JsonOption = False, home: HomeOption = None) -> None:
    """List the teams."""
    with admin(home) as client:
        teams = call(client, "GET", ADMIN_TEAMS).json()
    if json_out:
        typer.echo(json.dumps(teams, indent=2))
        return
    table = Table("ID", "NAME", "CREATED")
    for team in teams:
        table.add_row(team["teamID"], team["name"], team["createdAt"])
    Console().print(table)


@app.command()
def create(name: str, json_out: JsonOption = False, home: HomeOption = None) -> None:
    """Create a team named NAME and print its id."""
    with admin(home) as client:
        team = call(client, "POST", ADMIN_TEAMS, json={"name": name}).json()
    typer.echo(json.dumps(team, indent=2) if json_out else team["teamID"])


@app.command()
def delete(team: str, home: HomeOption = None) -> None:
    """Delete TEAM (id or name) and its keys.

    Refused while the team owns sandboxes, volumes or templates."""
    with admin(home) as client:
        call(client, "DELETE", f"{ADMIN_TEAMS}/{quote(team_id_of(client, team))}")
