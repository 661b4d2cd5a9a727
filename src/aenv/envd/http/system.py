"""envd's plain HTTP routes besides `/files`: `/health`, `/init`, `/envs`, `/metrics`, and
ours: `/sync`, `/aenv/volumes/release` and `/aenv/volumes/mount` (around a save with memory of
a sandbox with volumes, see `aenv.envd.mounts`), `/aenv/egress-ca` (after `/init` of a sandbox
with header rules, see `aenv.envd.trust`).

`POST /init` is how the host configures a sandbox after every boot or restore: env vars, access
token, default user and workdir, the clock, the hostname (also in `/etc/hosts`), the volumes to
mount, and fresh entropy for the kernel RNG (clones restored from one snapshot otherwise share
RNG state).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import fcntl
import os
import shutil
import socket
import struct
import time
from collections.abc import Callable
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aenv.envd import hosts, trust
from aenv.envd.auth import TOKEN_HEADER, tokens_equal
from aenv.envd.http.files import json_error
from aenv.envd.mounts import GuestMount, VolumeBusy, mount_all, release_all
from aenv.envd.settings import Settings
from aenv.envd.users import UnknownUserError, User

RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)
# Correct the guest clock only when it is off by more than this (restores jump it back).
CLOCK_SKEW_SECONDS = 1.0


class InitRequest(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    env_vars: dict[str, str] | None = Field(default=None, alias="envVars")
    access_token: str | None = Field(default=None, alias="accessToken")
    default_user: str | None = Field(default=None, alias="defaultUser")
    default_workdir: str | None = Field(default=None, alias="defaultWorkdir")
    timestamp: datetime | None = None
    hostname: str | None = None
    entropy: str | None = None  # base64 bytes from the host's CSPRNG
    # Ours, not E2B's NFS shape: the host attaches volumes as 9p devices (envd/mounts.py).
    volume_mounts: list[GuestMount] | None = Field(default=None, alias="volumeMounts")


class EgressCaRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    certificate: str = Field(max_length=16 * 1024)


class VolumesRequest(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    volume_mounts: list[GuestMount] = Field(alias="volumeMounts")


def reseed_rng(seed: bytes) -> None:
    """Credit `seed` to the kernel pool and force the CRNG to reseed from it now."""
    with open("/dev/urandom", "wb") as dev:
        info = struct.pack("ii", len(seed) * 8, len(seed)) + seed
        fcntl.ioctl(dev.fileno(), RNDADDENTROPY, info)
        fcntl.ioctl(dev.fileno(), RNDRESEEDCRNG)


async def health(_: Request) -> Response:
    return Response(status_code=204)


async def sync(_: Request) -> Response:
    """Flush the guest's dirty pages to its disks: the host calls this before it saves only the
    filesystem of a sandbox (a filesystem-only pause or snapshot), which drops the memory."""
    await asyncio.to_thread(os.sync)
    return Response(status_code=204)


async def release_volumes(request: Request) -> Response:
    """Unmount the sandbox's volumes before a save with memory: 204, or 409 when one is in use
    (then all stay mounted)."""
    return await _volumes(request, release_all)


async def mount_volumes(request: Request) -> Response:
    """Mount the sandbox's volumes again (in place of what `release_volumes` left)."""
    return await _volumes(request, mount_all)


async def _volumes(request: Request, apply: Callable[[list[GuestMount]], None]) -> Response:
    try:
        body = VolumesRequest.model_validate_json(await request.body() or b"{}")
    except ValidationError as e:
        return json_error(400, f"invalid volumes request: {e.errors(include_url=False)}")
    try:
        await asyncio.to_thread(apply, body.volume_mounts)
    except VolumeBusy as e:
        return json_error(409, e.strerror or str(e))
    except OSError as e:
        return json_error(500, e.strerror or str(e))
    return Response(status_code=204)


async def egress_ca(request: Request, settings: Settings) -> Response:
    """Trust the node's egress CA (`trust`); its variables join the default env, under the
    sandbox's own."""
    try:
        body = EgressCaRequest.model_validate_json(await request.body() or b"{}")
    except ValidationError as e:
        return json_error(400, f"invalid egress CA request: {e.errors(include_url=False)}")
    try:
        variables = await asyncio.to_thread(trust.install, body.certificate)
    except ValueError as e:
        return json_error(400, str(e))
    except OSError as e:
        return json_error(500, f"error installing the egress CA: {e}")
    settings.env_vars = {**variables, **settings.env_vars}
    return Response(status_code=204)


async def envs(_: Request, settings: Settings) -> Response:
    return JSONResponse(settings.env_vars, headers={"Cache-Control": "no-store"})


async def init(request: Request, settings: Settings) -> Response:
    try:
        body = InitRequest.model_validate_json(await request.body() or b"{}")
    except ValidationError as e:
        return json_error(400, f"invalid init request: {e.errors(include_url=False)}")
    if settings.access_token is not None and not (
        tokens_equal(settings.access_token, request.headers.get(TOKEN_HEADER))
        or tokens_equal(settings.access_token, body.access_token)
    ):
        return json_error(401, "access token reset not authorized")
    if body.default_user is not None:
        try:
            User.lookup(body.default_user)
        except UnknownUserError as e:
            return json_error(400, str(e))
    try:
        seed = base64.b64decode(body.entropy, validate=True) if body.entropy else b""
    except binascii.Error:
        return json_error(400, "entropy must be base64")
    try:
        if seed:
            reseed_rng(seed)
        if body.timestamp is not None:
            target = body.timestamp.timestamp()
            if abs(time.time() - target) > CLOCK_SKEW_SECONDS:
                time.clock_settime(time.CLOCK_REALTIME, target)
        if body.hostname:
            socket.sethostname(body.hostname)
            hosts.set_hostname(body.hostname)
        if body.volume_mounts:
            await asyncio.to_thread(mount_all, body.volume_mounts)
        else:  # only removes placeholders a save left (restored from a snapshot with volumes)
            mount_all([])
    except OSError as e:
        return json_error(500, f"error applying init: {e}")
    if body.env_vars is not None:
        settings.env_vars = dict(body.env_vars)
    settings.access_token = body.access_token or None
    if body.default_user is not None:
        settings.default_user = body.default_user
    if body.default_workdir is not None:
        settings.default_workdir = body.default_workdir or None
    return Response(status_code=204)


def _meminfo() -> dict[str, int]:
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
    return values


class CPUSampler:
    """CPU use between successive `/metrics` calls, from /proc/stat."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    def percent(self) -> float:
        total, idle = self._read()
        d_total, d_idle = total - self._last[0], idle - self._last[1]
        self._last = (total, idle)
        return round(100.0 * (d_total - d_idle) / d_total, 2) if d_total > 0 else 0.0


async def metrics(_: Request, sampler: CPUSampler) -> Response:
    mem = _meminfo()
    total = mem.get("MemTotal", 0)
    available = mem.get("MemAvailable", mem.get("MemFree", 0))
    cache = mem.get("Cached", 0) + mem.get("Buffers", 0)
    disk = shutil.disk_usage("/")
    return JSONResponse(
        {
            "ts": int(time.time()),
            "cpu_count": os.cpu_count() or 1,
            "cpu_used_pct": sampler.percent(),
            "mem_total": total,
            "mem_used": total - available,
            "mem_cache": cache,
            "mem_total_mib": total // (1024 * 1024),
            "mem_used_mib": (total - available) // (1024 * 1024),
            "disk_used": disk.used,
            "disk_total": disk.total,
        }
    )
