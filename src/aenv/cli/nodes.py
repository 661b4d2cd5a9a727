"""`aenv nodes` (the cluster's nodes: state, capacity, load), `aenv node drain/undrain` and
`aenv node events` (nodes drained, failed, back: `aenv.cluster.node_events`), read and written
in the cluster's Redis with the cluster secret (`AENV_REDIS_URL`, `AENV_CLUSTER_SECRET`), as a
gateway does. A secret other than the one the cluster's nodes registered with is refused before
anything is read or written."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from aenv.cli.node import HomeOption, JsonOption, console, fail
from aenv.config import ConfigError, load

if TYPE_CHECKING:
    from aenv.cluster.directory import Directory
    from aenv.cluster.secret import ClusterSecret

T = TypeVar("T")
RedisOption = Annotated[str | None, typer.Option(help="the cluster's Redis (AENV_REDIS_URL)")]
app = typer.Typer(help="List a cluster's nodes.")


def _with_directory(
    redis_url: str | None,
    home: Path | None,
    work: Callable[[Directory, ClusterSecret], Awaitable[T]],
) -> T:
    from aenv.cluster.directory import Directory
    from aenv.cluster.membership import cluster_access
    from aenv.cluster.registry import WrongClusterSecret
    from aenv.cluster.store import ClusterUnavailable, connect

    try:
        url, secret = cluster_access(load({"redis_url": redis_url, "home": home}), "this command")
    except ConfigError as e:
        console.print(f"[red]configuration error:[/red] {e}")
        raise typer.Exit(2) from e

    async def run() -> T:
        client = connect(url)
        try:
            directory = Directory(client, secret)
            # Before anything is written: a wrong secret must change nothing.
            await directory.check_secret()
            return await work(directory, secret)
        finally:
            await client.aclose()

    try:
        return asyncio.run(run())
    except (ClusterUnavailable, WrongClusterSecret) as e:
        fail(str(e))


@app.callback(invoke_without_command=True)
def nodes(
    redis_url: RedisOption = None, home: HomeOption = None, json_output: JsonOption = False
) -> None:
    """The cluster's live nodes: state, capacity and load."""

    from aenv.cluster.placement import load as load_of

    async def read(directory: Directory, _: ClusterSecret) -> list[dict[str, Any]]:
        draining = await directory.drains.draining()
        return [
            {
                "nodeID": n.node_id,
                "address": n.address,
                "state": "draining" if n.node_id in draining else "ready",
                "cpus": n.capacity.cpus,
                "memoryMB": n.capacity.memory_mb,
                "memoryFreeMB": n.capacity.memory_free_mb,
                "running": n.capacity.running,
                "paused": n.capacity.paused,
                # What placement ranks nodes by: running per CPU plus the share of memory used.
                "load": round(load_of(n), 3),
            }
            for n in await directory.live()
        ]

    listed = _with_directory(redis_url, home, read)
    if json_output:
        print(json.dumps(listed))
        return
    print(f"{'NODE':<20} {'STATE':<9} {'ADDRESS':<22} {'CPUS':>4} {'MEM FREE/TOTAL MB':>18} "
          f"{'RUNNING':>7} {'PAUSED':>6} {'LOAD':>6}")  # fmt: skip
    for n in listed:
        memory = f"{n['memoryFreeMB']}/{n['memoryMB']}"
        print(f"{n['nodeID']:<20} {n['state']:<9} {n['address']:<22} {n['cpus']:>4} "
              f"{memory:>18} {n['running']:>7} {n['paused']:>6} {n['load']:>6}")  # fmt: skip


def drain(
    node_id: Annotated[str, typer.Argument(help="the node's id")],
    redis_url: RedisOption = None,
    home: HomeOption = None,
    json_output: JsonOption = False,
) -> None:
    """No new sandboxes on NODE; its sandboxes are paused to the shared repository and resume
    on another node at their next connect."""
    from aenv.gateway.evacuate import evacuate
    from aenv.gateway.nodes import NodeClient

    async def work(directory: Directory, secret: ClusterSecret) -> list[dict[str, Any]]:
        await directory.drains.drain(node_id)
        client = NodeClient(secret)
        try:
            released = await evacuate(directory, client, node_id)
        except LookupError as e:
            fail(f"{e} (it is marked draining; it takes nothing when it returns)")
        finally:
            await client.aclose()
        return [{"sandboxID": r.sandbox_id, "error": r.error} for r in released]

    released = _with_directory(redis_url, home, work)
    failed = [r for r in released if r["error"] is not None]
    if json_output:
        print(json.dumps({"nodeID": node_id, "released": released}))
    else:
        for r in released:
            outcome = "released" if r["error"] is None else f"failed: {r['error']}"
            print(f"{r['sandboxID']}: {outcome}")
        print(
            f"node {node_id} drains: {len(released) - len(failed)} released, {len(failed)} failed"
        )
    if failed:
        raise typer.Exit(1)


def undrain(
    node_id: Annotated[str, typer.Argument(help="the node's id")],
    redis_url: RedisOption = None,
    home: HomeOption = None,
) -> None:
    """NODE takes new sandboxes again."""

    async def work(directory: Directory, _: ClusterSecret) -> None:
        await directory.drains.undrain(node_id)

    _with_directory(redis_url, home, work)
    print(f"node {node_id} takes new sandboxes")


def events(
    node_id: Annotated[str | None, typer.Option("--node", help="only this node's events")] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="how many, newest first")] = 20,
    redis_url: RedisOption = None,
    home: HomeOption = None,
    json_output: JsonOption = False,
) -> None:
    """The nodes' events, newest first: drained, undrained, failed (a lease that lapsed without
    its release) and back (a lease taken anew)."""
    from datetime import UTC, datetime

    async def read(directory: Directory, _: ClusterSecret) -> list[dict[str, Any]]:
        return [e.to_json() for e in await directory.node_events.list(limit, node_id)]

    listed = _with_directory(redis_url, home, read)
    if json_output:
        print(json.dumps(listed))
        return
    for e in listed:
        at = datetime.fromtimestamp(e["at"], UTC).strftime("%Y-%m-%d %H:%M:%S")
        print(f"{at}  {e['type']:<15} {e['nodeID']}")
