"""`aenv template ls`, `rm`, `build` and `logs`: the node's sandbox templates.

`build` reads a template definition (`aenv.template_definition`) or a Dockerfile
(`aenv.cli.dockerfile`) and builds it with the `e2b` SDK's `Template`, as any client would;
paths in COPY steps are relative to the file's directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import quote

import httpx
import typer
from rich.console import Console
from rich.table import Table

from aenv.cli.node import HomeOption, JsonOption, call, console, fail, node

if TYPE_CHECKING:
    from e2b.template.logger import LogEntry
    from e2b.template.main import TemplateBuilder, TemplateFinal

LOG_POLL_SECONDS = 0.5

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
                t["createdAt"], _status(client, t),
            )  # fmt: skip
    Console().print(table)


def _status(client: httpx.Client, template: dict[str, Any]) -> str:
    """The newest build's state, with its reason when it failed."""
    status = str(template.get("buildStatus") or "")
    if status != "error":
        return status
    path = f"/templates/{template['templateID']}/builds/{template['buildID']}/status"
    reason = call(client, "GET", path, params={"limit": 0}).json().get("reason") or {}
    return f"error: {reason.get('message', '')}".rstrip(": ")


@app.command()
def rm(template_ids: list[str], home: HomeOption = None) -> None:
    """Delete templates (by ID or alias)."""
    with node(home).client() as client:
        for template_id in template_ids:
            call(client, "DELETE", f"/templates/{quote(template_id, safe='')}")
            typer.echo(template_id)


def _print_entry(entry: LogEntry) -> None:
    style = {"error": "red", "warn": "yellow"}.get(entry.level, "dim")
    stamp = entry.timestamp.strftime("%H:%M:%S")
    console.print(f"[{style}]{stamp}[/{style}] ", end="")
    console.out(entry.message, highlight=False)


@app.command()
def build(
    file: Path,
    name: Annotated[str | None, typer.Option(help="template name (default: from FILE)")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="re-run every step")] = False,
    json_out: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """Build a template from a definition FILE or a Dockerfile, streaming its logs; prints the
    template ID."""
    # Imported here: the e2b SDK takes most of a second to import, and only a build needs it.
    from e2b import Template
    from e2b.exceptions import BuildException, FileUploadException, TemplateException

    from aenv.cli.dockerfile import UnsupportedDockerfile, is_dockerfile, template_from_dockerfile
    from aenv.template_definition import DefinitionError, read_definition, sdk_template

    template: TemplateBuilder | TemplateFinal
    if is_dockerfile(file):
        definition: dict[str, Any] = {}
        try:
            template = template_from_dockerfile(file)
        except (OSError, UnsupportedDockerfile) as e:
            fail(str(e))
    else:
        try:
            definition = read_definition(file)
            template = sdk_template(definition, file.resolve().parent)
        except DefinitionError as e:
            fail(str(e))
    name = name or definition.get("name")
    if not name:
        fail("no template name: give --name or a `name` in the definition")
    target = node(home)
    try:
        info = Template.build(
            template,
            str(name),
            skip_cache=no_cache,
            cpu_count=definition.get("cpuCount"),
            memory_mb=definition.get("memoryMB"),
            on_build_logs=_print_entry,
            api_key=target.api_key,
            api_url=target.api_url,
        )
    except (BuildException, FileUploadException, TemplateException) as e:
        fail(str(e))
    if json_out:
        typer.echo(json.dumps({"templateID": info.template_id, "buildID": info.build_id}))
    else:
        typer.echo(info.template_id)


@app.command()
def logs(
    template_id: str,
    build_id: str,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="until the build ends")] = False,
    json_out: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """A build's log (and, with --follow, what it logs until it ends)."""
    path = f"/templates/{quote(template_id, safe='')}/builds/{quote(build_id, safe='')}/status"
    offset = 0
    with node(home).client() as client:
        while True:
            status = call(client, "GET", path, params={"logsOffset": offset}).json()
            for entry in status["logEntries"]:
                if json_out:
                    typer.echo(json.dumps(entry))
                else:
                    typer.echo(f"{entry['timestamp']} {entry['level']:5} {entry['message']}")
            offset += len(status["logEntries"])
            if status["logEntries"]:
                continue
            if not follow or status["status"] in ("ready", "error"):
                break
            time.sleep(LOG_POLL_SECONDS)
    if status["status"] == "error":
        fail((status.get("reason") or {}).get("message", "build failed"))
    console.print(f"build {build_id}: {status['status']}")
