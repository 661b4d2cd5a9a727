"""`aenv template ls` and `aenv template rm`: the node's sandbox templates."""

from __future__ import annotations

import json
from urllib.parse import quote

import typer
from rich.console import Console
from rich.table import Table

from aenv.cli.node import HomeOption, JsonOption, call, node

app = typer.Typer(help="Sandbox templates.", no_args_is_help=True)


@app.command("ls")
def list_templates(json_out: JsonOption = False, home: HomeOption = None) -> None:
    """List templates."""
    with node(home).client() as client:
        templates = call(client, "GET", "/templates").json()
    if json_out:
        typer.echo(json.dumps(templates, indent=2))
        return
    table = Table("ID", "ALIASES", "VCPUS", "MEMORY MB", "DISK MB", "ENVD", "CREATED", "STATUS")
    for t in templates:
        table.add_row(
            t["templateID"], ",".join(t.get("aliases") or []), str(t["cpuCount"]),
            str(t["memoryMB"]), str(t["diskSizeMB"]), t.get("envdVersion") or "",
            t["createdAt"], t.get("buildStatus") or "",
        )  # fmt: skip
    Console().print(table)


@app.command()
def rm(template_ids: list[str], home: HomeOption = None) -> None:
    """Delete templates (by ID or alias)."""
    with node(home).client() as client:
        for template_id in template_ids:
            call(client, "DELETE", f"/templates/{quote(template_id, safe='')}")
            typer.echo(template_id)
