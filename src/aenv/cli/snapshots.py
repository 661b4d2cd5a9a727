"""`aenv pause`, `resume`, `snapshot`, `snapshots`, `fork` and `reset`: save, branch or restore
a sandbox's state.
`aenv rm --snapshot` (sandboxes.py) deletes snapshots with `delete_snapshot`."""

from __future__ import annotations

import json
from typing import Annotated, Any
from urllib.parse import quote

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aenv.api.extensions import RESET
from aenv.cli.node import HomeOption, JsonOption, call, console, fail, node

app = typer.Typer()

# Saving a VM's memory or starting several from it takes seconds under TCG, and a fork answers
# only when its last child runs: far longer than the client's default.
SLOW = 600
# Tokens that let anyone reach the sandbox: not for terminals and logs (as in `aenv info`).
SECRETS = ("envdAccessToken", "trafficAccessToken")

FilesystemOption = Annotated[
    bool,
    typer.Option("--filesystem", help="save only the filesystem: it cold-boots when started"),
]
TimeoutOption = Annotated[
    int | None, typer.Option("--timeout", help="seconds the sandbox then runs (default 300)")
]


@app.command()
def pause(sandbox_id: str, filesystem: FilesystemOption = False, home: HomeOption = None) -> None:
    """Pause a running sandbox; `resume` (or any SDK's connect) starts it again."""
    with node(home).client() as client, console.status(f"pausing {sandbox_id}..."):
        path = f"/sandboxes/{quote(sandbox_id)}/pause"
        call(client, "POST", path, json={"memory": not filesystem}, timeout=SLOW)
    typer.echo(sandbox_id)


@app.command()
def resume(
    sandbox_id: str, timeout: TimeoutOption = None, json_out: JsonOption = False,
    home: HomeOption = None,
) -> None:  # fmt: skip
    """Resume a paused sandbox (a running one gets the longer of its timeouts)."""
    body = {} if timeout is None else {"timeout": timeout}
    with node(home).client() as client, console.status(f"resuming {sandbox_id}..."):
        path = f"/v2/sandboxes/{quote(sandbox_id)}/connect"
        response = call(client, "POST", path, json=body, timeout=SLOW)
    resumed = response.status_code == 201  # 200: it was running
    if json_out:
        typer.echo(json.dumps({**_shown(response.json()), "resumed": resumed}, indent=2))
        return
    typer.echo(f"{sandbox_id} {'resumed' if resumed else 'was running'}")


@app.command()
def snapshot(
    sandbox_id: str,
    name: Annotated[
        str | None, typer.Option(help="a name to find it by; an existing one gets the new state")
    ] = None,
    filesystem: FilesystemOption = False,
    json_out: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """Save a sandbox's state as a snapshot (it keeps running): new sandboxes start from it."""
    body: dict[str, Any] = {"memory": not filesystem}
    if name is not None:
        body["name"] = name
    with node(home).client() as client, console.status(f"saving {sandbox_id}..."):
        path = f"/sandboxes/{quote(sandbox_id)}/snapshots"
        saved = call(client, "POST", path, json=body, timeout=SLOW).json()
    if json_out:
        typer.echo(json.dumps(saved, indent=2))
        return
    typer.echo(f"{saved['snapshotID']}  {','.join(saved['names'])}")


@app.command("snapshots")
def list_snapshots(
    sandbox: Annotated[str | None, typer.Option(help="only those taken of this sandbox")] = None,
    name: Annotated[str | None, typer.Option(help="only the one with this name or ID")] = None,
    json_out: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """List snapshots, newest first."""
    params = {k: v for k, v in (("sandboxID", sandbox), ("name", name)) if v is not None}
    with node(home).client() as client:
        found = _all_pages(client, params)
    if json_out:
        typer.echo(json.dumps(found, indent=2))
        return
    table = Table("ID", "NAMES")
    for s in found:
        table.add_row(s["snapshotID"], ",".join(s["names"]))
    Console().print(table)


@app.command()
def fork(
    source: Annotated[str, typer.Argument(help="a sandbox (running or paused) or a snapshot")],
    count: Annotated[int, typer.Option(help="how many sandboxes to start")] = 1,
    timeout: TimeoutOption = None,
    json_out: JsonOption = False,
    home: HomeOption = None,
) -> None:
    """Start sandboxes from the current state of a sandbox, which keeps running, or a snapshot.

    Prints one line per child: its ID, or its error on stderr; exit code 1 if any failed."""
    body: dict[str, Any] = {"count": count}
    if timeout is not None:
        body["timeout"] = timeout
    with node(home).client() as client, console.status(f"forking {source}..."):
        path = f"/sandboxes/{quote(source)}/fork"
        children = call(client, "POST", path, json=body, timeout=SLOW).json()
    if json_out:
        shown = [{"sandbox": _shown(c["sandbox"])} if "sandbox" in c else c for c in children]
        typer.echo(json.dumps(shown, indent=2))
    else:
        for child in children:
            if "sandbox" in child:
                typer.echo(child["sandbox"]["sandboxID"])
            else:
                error = child["error"]
                console.print(f"[red]{error['code']}:[/red] {escape(error['message'])}")
    if any("error" in c for c in children):
        raise typer.Exit(1)


@app.command()
def reset(
    sandbox_id: str,
    snapshot: Annotated[str, typer.Argument(help="a snapshot or template (ID or name)")],
    timeout: Annotated[
        int | None, typer.Option("--timeout", help="seconds it then runs (default: its end stays)")
    ] = None,
    home: HomeOption = None,
) -> None:
    """Return a running sandbox to a snapshot's state, in place: its ID, URLs and tokens stay."""
    body: dict[str, Any] = {"snapshotID": snapshot}
    if timeout is not None:
        body["timeout"] = timeout
    with node(home).client() as client, console.status(f"resetting {sandbox_id}..."):
        path = RESET.replace("{sandbox_id}", quote(sandbox_id, safe=""))
        call(client, "POST", path, json=body, timeout=SLOW)
    typer.echo(sandbox_id)


def delete_snapshot(client: httpx.Client, ref: str) -> None:
    """Delete snapshot `ref` (ID or name). The API deletes snapshots as templates: looking it up
    among snapshots first keeps a template such as `base` from being deleted by mistake."""
    found = call(client, "GET", "/snapshots", params={"name": ref}).json()
    if not found:
        fail(f"snapshot '{ref}' not found")
    call(client, "DELETE", f"/templates/{quote(found[0]['snapshotID'], safe='')}")


def _all_pages(client: httpx.Client, params: dict[str, str]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    while True:
        response = call(client, "GET", "/snapshots", params=params)
        found += response.json()
        token = response.headers.get("X-Next-Token")
        if token is None:
            return found
        params = {**params, "nextToken": token}


def _shown(sandbox: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sandbox.items() if k not in SECRETS}
