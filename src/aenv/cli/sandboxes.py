"""`aenv ls`, `info`, `timeout`, `rm` and `logs`: sandbox commands over the control-plane API
(`rm --snapshot` deletes snapshots; `rm --metadata` removes what a filter selects)."""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Annotated, Any
from urllib.parse import quote, urlencode

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aenv.api.extensions import BULK_SANDBOXES, BULK_SNAPSHOTS
from aenv.cli.node import HomeOption, JsonOption, call, check, console, fail, node, send
from aenv.cli.snapshots import SLOW, delete_snapshot

app = typer.Typer()
FOLLOW_INTERVAL = 1.0  # seconds between polls of `logs --follow`
LOG_PAGE = 1000  # the most lines the v2 logs route returns at once


@app.command("ls")
def list_sandboxes(json_out: JsonOption = False, home: HomeOption = None) -> None:
    """List running and paused sandboxes."""
    with node(home).client() as client:
        sandboxes = call(client, "GET", "/v2/sandboxes", params={"limit": 100}).json()
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
    with node(home).client() as client:
        detail = call(client, "GET", f"/sandboxes/{quote(sandbox_id)}").json()
    detail.pop("envdAccessToken", None)  # a secret: not for terminals and logs
    if json_out:
        typer.echo(json.dumps(detail, indent=2))
        return
    for key, value in detail.items():
        typer.echo(f"{key:20} {value}")


@app.command()
def timeout(sandbox_id: str, seconds: int, home: HomeOption = None) -> None:
    """Set a sandbox to end SECONDS from now."""
    with node(home).client() as client:
        call(client, "POST", f"/sandboxes/{quote(sandbox_id)}/timeout", json={"timeout": seconds})


@app.command()
def rm(
    ids: Annotated[list[str] | None, typer.Argument(help="sandboxes (or snapshots) by ID")] = None,
    snapshot: Annotated[
        bool, typer.Option("--snapshot", help="the IDs are snapshots (ID or name) to delete")
    ] = False,
    metadata: Annotated[
        list[str] | None,
        typer.Option(
            "--metadata",
            help="KEY=VALUE (repeatable): instead of IDs, every sandbox whose metadata has all"
            " of them (with --snapshot, every snapshot taken of one)",
        ),
    ] = None,
    home: HomeOption = None,
) -> None:
    """Kill sandboxes, or delete snapshots, by ID or by metadata."""
    if bool(ids) == bool(metadata):
        fail("name IDs or --metadata, not both (nor neither)")
    with node(home).client() as client:
        if metadata:
            _rm_matching(client, _labels(metadata), snapshot)
            return
        for ref in ids or ():
            if snapshot:
                delete_snapshot(client, ref)
            else:
                call(client, "DELETE", f"/sandboxes/{quote(ref)}")
            typer.echo(ref)


def _labels(pairs: list[str]) -> dict[str, str]:
    """`KEY=VALUE` options as a metadata filter."""
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            fail(f"--metadata {pair!r}: expected KEY=VALUE")
        labels[key] = value
    return labels


def _rm_matching(client: httpx.Client, labels: dict[str, str], snapshots: bool) -> None:
    """Remove what the filter selects, one ID a line; errors on stderr, exit 1 if any."""
    params = {"metadata": urlencode(labels)}
    if snapshots:
        gone = call(client, "DELETE", BULK_SNAPSHOTS, params=params).json()["snapshots"]
        for s in gone:
            typer.echo(s["snapshotID"])
        return
    path = f"{BULK_SANDBOXES}/kill"
    outcomes = call(client, "POST", path, params=params, timeout=SLOW).json()["sandboxes"]
    for outcome in outcomes:
        if "error" in outcome:
            error = outcome["error"]
            console.print(
                f"[red]{outcome['sandboxID']} {error['code']}:[/red] {escape(error['message'])}"
            )
        else:
            typer.echo(outcome["sandboxID"])
    if any("error" in o for o in outcomes):
        raise typer.Exit(1)


@app.command()
def logs(
    sandbox_id: str,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="keep printing new lines until the sandbox ends")
    ] = False,
    json_out: Annotated[
        bool,
        typer.Option("--json", help="log entries as a JSON array (JSON lines with --follow)"),
    ] = False,
    home: HomeOption = None,
) -> None:
    """Print a sandbox's logs (its guest console output): the latest 1000 lines."""
    path = f"/v2/sandboxes/{quote(sandbox_id)}/logs"
    with node(home).client() as client:
        latest = call(client, "GET", path, params={"direction": "backward", "limit": LOG_PAGE})
        entries: list[dict[str, Any]] = latest.json()["logs"][::-1]
        if json_out and not follow:
            typer.echo(json.dumps(entries, indent=2))
            return
        _print(entries, json_out)
        if follow:
            try:
                _follow(client, path, entries, json_out)
            except KeyboardInterrupt:
                raise typer.Exit(130) from None


def _follow(client: httpx.Client, path: str, shown: list[dict[str, Any]], json_out: bool) -> None:
    """Poll forward from the last shown stamp. Stamps never change, so the lines at that stamp
    come back first, in the order already shown, and are skipped."""
    last = _ms(shown[-1]["timestamp"]) if shown else None
    repeated = sum(1 for e in shown if _ms(e["timestamp"]) == last)
    while True:
        time.sleep(FOLLOW_INTERVAL)
        params: dict[str, Any] = {"direction": "forward", "limit": LOG_PAGE}
        if last is not None:
            params["cursor"] = last
        response = send(client, "GET", path, params=params)
        if response.status_code == 404:
            console.print("the sandbox has ended")
            return
        new = check(response).json()["logs"][repeated:]
        _print(new, json_out)
        if new:
            stamp = _ms(new[-1]["timestamp"])
            same = sum(1 for e in new if _ms(e["timestamp"]) == stamp)
            repeated = same + repeated if stamp == last else same
            last = stamp


def _print(entries: list[dict[str, Any]], json_out: bool) -> None:
    for entry in entries:
        typer.echo(json.dumps(entry) if json_out else f"{entry['timestamp']}  {entry['message']}")


def _ms(timestamp: str) -> int:
    return round(datetime.fromisoformat(timestamp).timestamp() * 1000)
