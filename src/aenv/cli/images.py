"""`aenv pull`: an OCI image into this machine's blob cache (`$AENV_HOME/cache/oci`), with a
progress bar per layer. It runs locally, not through a node: the cache is the one template
builds on this machine use. Registering the image as a template comes with the builder."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import httpx
import typer
from rich.filesize import decimal
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TransferSpeedColumn,
)

from aenv.cli.node import JsonOption, console, fail
from aenv.config import load
from aenv.oci import Credentials, ImageError, Platform, PulledImage, PullProgress, pull

app = typer.Typer()


@app.command("pull")
def pull_image(
    ref: Annotated[str, typer.Argument(help="image reference, e.g. alpine:3.20")],
    platform: Annotated[str, typer.Option(help="os/arch or os/arch/variant")] = "linux/amd64",
    username: Annotated[str | None, typer.Option(help="registry user")] = None,
    password: Annotated[
        str | None, typer.Option(envvar="AENV_REGISTRY_PASSWORD", help="registry password")
    ] = None,
    json_out: JsonOption = False,
    home: Annotated[Path | None, typer.Option(help="data directory (its cache/oci)")] = None,
) -> None:
    """Pull an image into the local blob cache; print its digest and layers."""
    os_, _, arch = platform.partition("/")
    arch, _, variant = arch.partition("/")
    if not os_ or not arch:
        fail(f"--platform {platform!r}: expected os/arch[/variant]")
    credentials = Credentials(username, password or "") if username else None
    cache = load({"home": home}).paths.oci_cache
    try:
        image = asyncio.run(
            _pull_with_bar(ref, cache, credentials, Platform(os_, arch, variant or None))
        )
    except ImageError as e:
        fail(str(e))
    except httpx.HTTPError as e:  # unreachable registry, connection cut
        fail(f"{ref}: {e}")
    if json_out:
        typer.echo(json.dumps(_as_json(image), indent=2))
        return
    typer.echo(f"{image.reference}\n  digest   {image.digest}\n  platform {image.platform}")
    for layer in image.layers:
        typer.echo(f"  layer    {layer.digest}  {decimal(layer.size)}")
    typer.echo(f"  total    {decimal(sum(layer.size for layer in image.layers))}")


async def _pull_with_bar(
    ref: str, cache: Path, credentials: Credentials | None, platform: Platform
) -> PulledImage:
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
    )
    # Started at the first layer, so an early error is not preceded by an empty bar.
    bar = Progress(*columns, console=console)
    tasks: dict[str, TaskID] = {}

    def report(p: PullProgress) -> None:
        if not tasks:
            bar.start()
        if p.digest not in tasks:
            tasks[p.digest] = bar.add_task(p.digest[7:19], total=p.size)
        bar.update(tasks[p.digest], completed=p.done)

    try:
        return await pull(ref, cache, credentials=credentials, platform=platform, progress=report)
    finally:
        if tasks:
            bar.stop()


def _as_json(image: PulledImage) -> dict[str, object]:
    return {
        "reference": str(image.reference),
        "digest": image.digest,
        "indexDigest": image.index_digest,
        "configDigest": image.config_digest,
        "platform": str(image.platform),
        "layers": [
            {"digest": layer.digest, "size": layer.size, "mediaType": layer.media_type}
            for layer in image.layers
        ],
        "config": image.config.get("config") or {},
    }
