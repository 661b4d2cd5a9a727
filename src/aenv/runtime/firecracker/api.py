"""Async client for one Firecracker process's REST API on its unix socket.

Owns the wire protocol only: which method and path each operation uses, the typed body it sends
(`models.py`), and turning Firecracker's error answers (`{"fault_message": ...}`) into
`FirecrackerApiError`. What to configure, and in which order, is the driver's business.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx
from pydantic import ValidationError

from aenv.runtime.firecracker import models as m

_R = TypeVar("_R", bound=m.Response)

# Firecracker's API answers in microseconds, except snapshot create/load, which copy or map the
# whole guest memory: those get a long timeout of their own.
DEFAULT_TIMEOUT_S = 10.0
SNAPSHOT_TIMEOUT_S = 300.0
_SUN_PATH_MAX = 108  # sizeof(sockaddr_un.sun_path), including the terminating NUL


class FirecrackerError(RuntimeError):
    """Talking to a Firecracker process failed."""


class FirecrackerConnectionError(FirecrackerError):
    """The API socket did not answer (process not started yet, or gone)."""


class FirecrackerApiError(FirecrackerError):
    """Firecracker refused a request; `fault_message` is its own explanation."""

    def __init__(self, method: str, path: str, status: int, fault_message: str) -> None:
        super().__init__(f"firecracker {method} {path} -> {status}: {fault_message}")
        self.method = method
        self.path = path
        self.status = status
        self.fault_message = fault_message


class FirecrackerApi:
    """One connection pool to one API socket. Use as an async context manager or `aclose()`."""

    def __init__(self, socket_path: Path, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.socket_path = socket_path
        self._dir_fd: int | None = None
        uds = str(socket_path)
        if len(os.fsencode(uds)) >= _SUN_PATH_MAX:
            # A unix socket address holds 107 bytes; workdirs can be deeper. Connecting through
            # an open handle on the directory keeps the address short.
            self._dir_fd = os.open(socket_path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            uds = f"/proc/self/fd/{self._dir_fd}/{socket_path.name}"
        # The host part is ignored on a unix socket; Firecracker routes on the path only.
        self._http = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=uds),
            base_url="http://localhost",
            timeout=timeout,
            headers={"Accept": "application/json"},
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    # --- transport -------------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        body: m.Request | Mapping[str, Any] | None = None,
        *,
        slow: bool = False,
    ) -> httpx.Response:
        payload = body.body() if isinstance(body, m.Request) else body
        kwargs: dict[str, Any] = {}
        if payload is not None:
            kwargs["content"] = json.dumps(payload).encode()
            kwargs["headers"] = {"Content-Type": "application/json"}
        if slow:
            kwargs["timeout"] = SNAPSHOT_TIMEOUT_S
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise FirecrackerConnectionError(
                f"firecracker API socket {self.socket_path} did not answer {method} {path}: {exc!r}"
            ) from exc
        if response.status_code >= 300:
            raise FirecrackerApiError(method, path, response.status_code, _fault(response))
        return response

    async def _get(self, path: str, model: type[_R]) -> _R:
        response = await self._call("GET", path)
        try:
            return model.model_validate_json(response.content)
        except ValidationError as exc:
            raise FirecrackerError(f"unexpected answer to GET {path}: {exc}") from exc

    # --- information -----------------------------------------------------------------------------

    async def describe_instance(self) -> m.InstanceInfo:
        return await self._get("/", m.InstanceInfo)

    async def version(self) -> m.FirecrackerVersion:
        return await self._get("/version", m.FirecrackerVersion)

    # --- pre-boot configuration ------------------------------------------------------------------

    async def put_logger(self, logger: m.Logger) -> None:
        await self._call("PUT", "/logger", logger)

    async def put_metrics(self, metrics: m.Metrics) -> None:
        await self._call("PUT", "/metrics", metrics)

    async def put_machine_config(self, config: m.MachineConfiguration) -> None:
        await self._call("PUT", "/machine-config", config)

    async def put_boot_source(self, boot: m.BootSource) -> None:
        await self._call("PUT", "/boot-source", boot)

    async def put_drive(self, drive: m.Drive) -> None:
        await self._call("PUT", f"/drives/{drive.drive_id}", drive)

    async def put_network_interface(self, iface: m.NetworkInterface) -> None:
        await self._call("PUT", f"/network-interfaces/{iface.iface_id}", iface)

    async def put_vsock(self, vsock: m.Vsock) -> None:
        await self._call("PUT", "/vsock", vsock)

    async def put_balloon(self, balloon: m.Balloon) -> None:
        await self._call("PUT", "/balloon", balloon)

    async def put_entropy(self, entropy: m.EntropyDevice) -> None:
        await self._call("PUT", "/entropy", entropy)

    async def put_serial(self, serial: m.SerialDevice) -> None:
        await self._call("PUT", "/serial", serial)

    async def put_mmds_config(self, config: m.MmdsConfig) -> None:
        await self._call("PUT", "/mmds/config", config)

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        await self._call("PUT", "/actions", m.InstanceActionInfo(action_type="InstanceStart"))

    async def flush_metrics(self) -> None:
        await self._call("PUT", "/actions", m.InstanceActionInfo(action_type="FlushMetrics"))

    async def send_ctrl_alt_del(self) -> None:
        await self._call("PUT", "/actions", m.InstanceActionInfo(action_type="SendCtrlAltDel"))

    async def pause(self) -> None:
        await self._call("PATCH", "/vm", m.Vm(state="Paused"))

    async def resume(self) -> None:
        await self._call("PATCH", "/vm", m.Vm(state="Resumed"))

    async def create_snapshot(self, params: m.SnapshotCreateParams) -> None:
        await self._call("PUT", "/snapshot/create", params, slow=True)

    async def load_snapshot(self, params: m.SnapshotLoadParams) -> None:
        await self._call("PUT", "/snapshot/load", params, slow=True)

    # --- post-boot updates -----------------------------------------------------------------------

    async def patch_drive(self, drive: m.PartialDrive) -> None:
        await self._call("PATCH", f"/drives/{drive.drive_id}", drive)

    async def patch_network_interface(self, iface: m.PartialNetworkInterface) -> None:
        await self._call("PATCH", f"/network-interfaces/{iface.iface_id}", iface)

    # --- balloon ---------------------------------------------------------------------------------

    async def describe_balloon(self) -> m.BalloonConfig:
        return await self._get("/balloon", m.BalloonConfig)

    async def patch_balloon(self, update: m.BalloonUpdate) -> None:
        await self._call("PATCH", "/balloon", update)

    async def balloon_stats(self) -> m.BalloonStats:
        return await self._get("/balloon/statistics", m.BalloonStats)

    async def patch_balloon_stats_interval(self, update: m.BalloonStatsUpdate) -> None:
        await self._call("PATCH", "/balloon/statistics", update)

    async def start_balloon_hinting(self, cmd: m.BalloonStartCmd) -> None:
        await self._call("PATCH", "/balloon/hinting/start", cmd)

    async def balloon_hinting_status(self) -> m.BalloonHintingStatus:
        return await self._get("/balloon/hinting/status", m.BalloonHintingStatus)

    async def stop_balloon_hinting(self) -> None:
        await self._call("PATCH", "/balloon/hinting/stop")

    # --- MMDS ------------------------------------------------------------------------------------

    async def put_mmds(self, data: Mapping[str, Any]) -> None:
        await self._call("PUT", "/mmds", data)

    async def patch_mmds(self, data: Mapping[str, Any]) -> None:
        await self._call("PATCH", "/mmds", data)

    async def get_mmds(self) -> dict[str, Any]:
        response = await self._call("GET", "/mmds")
        data = response.json()
        if not isinstance(data, dict):
            raise FirecrackerError(f"MMDS store is not a JSON object: {data!r}")
        return data


def _fault(response: httpx.Response) -> str:
    """Firecracker's explanation of an error, or the raw body if it sent something else."""
    try:
        data = response.json()
    except ValueError:
        return response.text or response.reason_phrase
    message = data.get("fault_message") if isinstance(data, dict) else None
    return message if isinstance(message, str) else response.text
