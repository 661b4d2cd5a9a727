"""How `aenv` commands reach a node: its API URL, sandbox URL and key, the HTTP client, and
errors reported as one line with exit code 1."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
from rich.console import Console
from rich.markup import escape

from aenv.api.extensions import ADMIN_HEADER
from aenv.config import load

# Messages go to stderr so stdout carries only data; soft wrap keeps an error on one line.
console = Console(stderr=True, soft_wrap=True)

JsonOption = Annotated[bool, typer.Option("--json", help="machine-readable output")]
HomeOption = Annotated[Path | None, typer.Option(help="data directory (for the API key)")]


@dataclass(frozen=True)
class Node:
    api_url: str
    sandbox_url: str  # where SDK traffic to sandboxes goes (our data-plane proxy)
    api_key: str

    def sdk_options(self) -> dict[str, Any]:
        """Keyword arguments that point the `e2b` SDK at this node."""
        return {"api_url": self.api_url, "sandbox_url": self.sandbox_url, "api_key": self.api_key}

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.api_url, headers={"X-API-KEY": self.api_key}, timeout=60)


def node(home: Path | None) -> Node:
    """`E2B_API_URL`/`E2B_SANDBOX_URL`/`E2B_API_KEY` when set, else the local node's."""
    config = load({"home": home})
    key = os.environ.get("E2B_API_KEY")
    if key is None and config.paths.api_key.exists():
        key = config.paths.api_key.read_text().strip()
    if key is None:
        fail("no API key: set E2B_API_KEY or start the server once")
    api_url = os.environ.get("E2B_API_URL", f"http://localhost:{config.port}")
    # One port serves both planes, so the API URL reaches sandboxes too unless told otherwise.
    return Node(api_url, os.environ.get("E2B_SANDBOX_URL", api_url), key)


def admin(home: Path | None) -> httpx.Client:
    """A client of the node's operator routes: `AENV_ADMIN_TOKEN` when set, else the local
    node's admin token (its home's `admin-token`, readable by the operator only)."""
    config = load({"home": home})
    token = os.environ.get("AENV_ADMIN_TOKEN")
    if token is None and config.paths.admin_token.exists():
        token = config.paths.admin_token.read_text().strip()
    if not token:
        fail("no admin token: set AENV_ADMIN_TOKEN or run as the node's operator (its home)")
    api_url = os.environ.get("E2B_API_URL", f"http://localhost:{config.port}")
    return httpx.Client(base_url=api_url, headers={ADMIN_HEADER: token}, timeout=60)


def fail(message: str) -> NoReturn:
    console.print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(1)


def send(client: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """A request; an unreachable node ends the command."""
    try:
        return client.request(method, path, **kwargs)
    except httpx.TransportError as e:
        fail(f"cannot reach the node at {client.base_url}: {e}")


def check(response: httpx.Response) -> httpx.Response:
    """The response, or the command ends with the API's error message."""
    if response.status_code >= 400:
        try:
            message = response.json().get("message", response.text)
        except ValueError:
            message = response.text
        console.print(f"[red]{response.status_code}:[/red] {escape(str(message))}")
        raise typer.Exit(1)
    return response


def call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return check(send(client, method, path, **kwargs))
