"""The extension routes called with an E2B SDK's connection settings (`ConnectionConfig`), and
their errors raised as the SDK raises those of its own routes.

Each call is described once (`_Call`: method, path, query, body) and sent by `_send` or
`_send_async`; the public functions pair them for `Sandbox` and `AsyncSandbox` users.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Unpack
from urllib.parse import quote, urlencode

import httpx
from e2b import ApiParams, AsyncSandbox, ConnectionConfig, Sandbox
from e2b.api import api_exception_from_code, handle_api_exception
from e2b.exceptions import NotFoundException

from aenv.api.extensions import BATCH_FORK, BULK_SANDBOXES, BULK_SNAPSHOTS, RESET

# What a bulk call answers per sandbox: its id, and its error's message when it failed.
Outcomes = dict[str, str | None]


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    params: Mapping[str, str] = field(default_factory=dict)
    body: Any = None


def _request(config: ConnectionConfig, call: _Call) -> dict[str, Any]:
    """The arguments of `httpx.Client.request`: the URL, the API key as the SDK sends it, the
    SDK's headers and request timeout."""
    headers = {**config.headers}
    if config.api_key:
        headers["X-API-Key"] = config.api_key
    return {
        "method": call.method,
        "url": config.api_url.rstrip("/") + call.path,
        "params": dict(call.params),
        "headers": headers,
        "json": call.body,
        "timeout": config.get_request_timeout(),
    }


def _checked(response: httpx.Response) -> Any:
    if response.status_code == 404:  # the SDK's own routes say which thing is missing
        raise handle_api_exception(response, NotFoundException)
    if response.status_code >= 300:
        raise handle_api_exception(response)
    return response.json() if response.content else None


def _send(config: ConnectionConfig, call: _Call) -> Any:
    with httpx.Client(proxy=config.proxy) as client:
        return _checked(client.request(**_request(config, call)))


async def _send_async(config: ConnectionConfig, call: _Call) -> Any:
    async with httpx.AsyncClient(proxy=config.proxy) as client:
        return _checked(await client.request(**_request(config, call)))


def _reset(sandbox_id: str, snapshot_id: str, timeout: int | None) -> _Call:
    path = RESET.replace("{sandbox_id}", quote(sandbox_id, safe=""))
    body: dict[str, Any] = {"snapshotID": snapshot_id}
    if timeout is not None:
        body["timeout"] = timeout
    return _Call("POST", path, body=body)


def reset(sandbox: Sandbox, snapshot_id: str, timeout: int | None = None) -> None:
    """Return `sandbox` to the state of snapshot (or template) `snapshot_id`, in place: its
    id, URLs and envd token stay, so `sandbox` goes on working. Raises the SDK's
    `NotFoundException` for an unknown sandbox or snapshot, `SandboxException` otherwise (the
    sandbox then runs on as it was). With `timeout`, the sandbox then ends that many seconds
    from now (as `set_timeout`); without, its end stays."""
    _send(sandbox.connection_config, _reset(sandbox.sandbox_id, snapshot_id, timeout))


async def reset_async(sandbox: AsyncSandbox, snapshot_id: str, timeout: int | None = None) -> None:
    """`reset` for an `AsyncSandbox`."""
    call = _reset(sandbox.sandbox_id, snapshot_id, timeout)
    await _send_async(sandbox.connection_config, call)


def _bulk(action: str, metadata: Mapping[str, str], body: Any = None) -> _Call:
    return _Call("POST", f"{BULK_SANDBOXES}/{action}", {"metadata": urlencode(metadata)}, body)


def _outcomes(answer: Any) -> Outcomes:
    return {
        o["sandboxID"]: o["error"]["message"] if "error" in o else None for o in answer["sandboxes"]
    }


def kill_by_metadata(metadata: Mapping[str, str], **opts: Unpack[ApiParams]) -> Outcomes:
    """Kill every sandbox (running or paused) whose metadata holds all of `metadata`. `opts`
    are the SDK's connection options (`api_key`, `api_url`, ...), as for `Sandbox.list`."""
    return _outcomes(_send(ConnectionConfig(**opts), _bulk("kill", metadata)))


async def kill_by_metadata_async(
    metadata: Mapping[str, str], **opts: Unpack[ApiParams]
) -> Outcomes:
    """`kill_by_metadata` for asyncio."""
    return _outcomes(await _send_async(ConnectionConfig(**opts), _bulk("kill", metadata)))


def pause_by_metadata(metadata: Mapping[str, str], **opts: Unpack[ApiParams]) -> Outcomes:
    """Pause every running sandbox whose metadata holds all of `metadata`."""
    return _outcomes(_send(ConnectionConfig(**opts), _bulk("pause", metadata)))


async def pause_by_metadata_async(
    metadata: Mapping[str, str], **opts: Unpack[ApiParams]
) -> Outcomes:
    """`pause_by_metadata` for asyncio."""
    return _outcomes(await _send_async(ConnectionConfig(**opts), _bulk("pause", metadata)))


def set_timeout_by_metadata(
    metadata: Mapping[str, str], timeout: int, **opts: Unpack[ApiParams]
) -> Outcomes:
    """Every sandbox whose metadata holds all of `metadata` now ends `timeout` seconds from
    now."""
    call = _bulk("timeout", metadata, {"timeout": timeout})
    return _outcomes(_send(ConnectionConfig(**opts), call))


async def set_timeout_by_metadata_async(
    metadata: Mapping[str, str], timeout: int, **opts: Unpack[ApiParams]
) -> Outcomes:
    """`set_timeout_by_metadata` for asyncio."""
    call = _bulk("timeout", metadata, {"timeout": timeout})
    return _outcomes(await _send_async(ConnectionConfig(**opts), call))


def _delete_snapshots(metadata: Mapping[str, str]) -> _Call:
    return _Call("DELETE", BULK_SNAPSHOTS, {"metadata": urlencode(metadata)})


def delete_snapshots_by_metadata(
    metadata: Mapping[str, str], **opts: Unpack[ApiParams]
) -> list[str]:
    """Delete every snapshot taken of a sandbox whose metadata held all of `metadata`; their
    ids."""
    answer = _send(ConnectionConfig(**opts), _delete_snapshots(metadata))
    return [s["snapshotID"] for s in answer["snapshots"]]


async def delete_snapshots_by_metadata_async(
    metadata: Mapping[str, str], **opts: Unpack[ApiParams]
) -> list[str]:
    """`delete_snapshots_by_metadata` for asyncio."""
    answer = await _send_async(ConnectionConfig(**opts), _delete_snapshots(metadata))
    return [s["snapshotID"] for s in answer["snapshots"]]


@dataclass(frozen=True)
class ForkChild:
    """One child of `fork_batch`: what it adds to its source's metadata and env vars."""

    metadata: Mapping[str, str] = field(default_factory=dict)
    envs: Mapping[str, str] = field(default_factory=dict)


def _fork_batch(source: str, children: Sequence[ForkChild], timeout: int) -> _Call:
    path = BATCH_FORK.replace("{sandbox_id}", quote(source, safe=""))
    entries = [{"metadata": dict(c.metadata), "envVars": dict(c.envs)} for c in children]
    return _Call("POST", path, body={"timeout": timeout, "children": entries})


def _refused(entry: Mapping[str, Any]) -> Exception:
    """A child that did not start, as the SDK's `fork` reports one (429: `RateLimitException`)."""
    error = entry["error"]
    return api_exception_from_code(error["code"], error["message"])


def fork_batch(
    source: str, children: Sequence[ForkChild], timeout: int = 300, **opts: Unpack[ApiParams]
) -> list[Sandbox | Exception]:
    """Start one sandbox per entry of `children` from sandbox or snapshot `source`, each with
    its entry's metadata and env vars over the source's: one result per child, in order, a
    `Sandbox` or the exception saying why it did not start (as `Sandbox.fork` answers)."""
    entries = _send(ConnectionConfig(**opts), _fork_batch(source, children, timeout))
    return [
        _refused(e) if "error" in e else Sandbox.connect(e["sandbox"]["sandboxID"], timeout, **opts)
        for e in entries
    ]


async def fork_batch_async(
    source: str, children: Sequence[ForkChild], timeout: int = 300, **opts: Unpack[ApiParams]
) -> list[AsyncSandbox | Exception]:
    """`fork_batch` for asyncio: `AsyncSandbox` results."""
    call = _fork_batch(source, children, timeout)
    entries = await _send_async(ConnectionConfig(**opts), call)
    results: list[AsyncSandbox | Exception] = []
    for entry in entries:
        if "error" in entry:
            results.append(_refused(entry))
        else:
            sandbox_id = entry["sandbox"]["sandboxID"]
            results.append(await AsyncSandbox.connect(sandbox_id, timeout, **opts))
    return results
