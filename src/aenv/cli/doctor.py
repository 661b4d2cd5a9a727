"""`aenv doctor`: check this host for a node, one line a check (`aenv.doctor`)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from aenv.cli.node import console
from aenv.config import ConfigError, load


def doctor(
    home: Annotated[Path | None, typer.Option(help="data directory (AENV_HOME)")] = None,
) -> None:
    """Check this host as a node's first hour would; exit 1 if a check failed."""
    # Imported here: the checks bring in the runtime and the network, which only they need.
    from aenv.doctor import Outcome, examine

    style_of = {Outcome.PASS: "green", Outcome.WARN: "yellow", Outcome.FAIL: "red"}
    try:
        config = load({"home": home})
    except ConfigError as e:
        console.print(f"[red]configuration error:[/red] {e}")
        raise typer.Exit(2) from e
    results = asyncio.run(examine(config))
    out = Console(highlight=False)
    for r in results:
        style = style_of[r.outcome]
        out.print(f"[{style}]{r.outcome:<4}[/{style}] {r.name:<7} {r.detail}", soft_wrap=True)
    if any(r.outcome is Outcome.FAIL for r in results):
        raise typer.Exit(1)
