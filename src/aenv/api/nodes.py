"""`GET /nodes`: this node as the E2B API's `Node` (one node until clustering lands)."""

from __future__ import annotations

import os
import platform
import socket
import time
from typing import Any

import psutil
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv import __version__
from aenv.api.requests import check_query
from aenv.api.sandboxes import rfc3339
from aenv.orchestrator.lifecycle import Orchestrator
from aenv.orchestrator.states import SandboxState


def _cpu_info() -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break
    except OSError:
        pass
    return {
        "cpuFamily": fields.get("cpu family", ""),
        "cpuModel": fields.get("model", ""),
        "cpuModelName": fields.get("model name", ""),
        "cpuArchitecture": platform.machine(),
    }


class NodeRoutes:
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orc = orchestrator
        self.started = time.time()
        self.node_id = socket.gethostname()

    def routes(self) -> list[Route]:
        return [Route("/nodes", self.list, methods=["GET"])]

    def _node(self) -> dict[str, Any]:
        records = self.orc.catalog.list()
        running = [r for r in records if r.state.public is not None]
        memory = psutil.virtual_memory()
        home = self.orc.config.home
        disk = psutil.disk_usage(str(home))
        return {
            "id": self.node_id,
            "serviceInstanceID": f"{self.node_id}-{os.getpid()}",
            "clusterID": "local",
            "status": "ready",
            "statusChangedAt": rfc3339(self.started),
            "sandboxCount": len(running),
            "sandboxStartingCount": sum(r.state is SandboxState.CREATING for r in records),
            "createSuccesses": self.orc.stats.succeeded,
            "createFails": self.orc.stats.failed,
            "version": __version__,
            "commit": "",
            "machineInfo": _cpu_info(),
            "metrics": {
                "allocatedCPU": sum(r.cpu_count for r in running),
                "allocatedMemoryBytes": sum(r.memory_mb for r in running) * 1024 * 1024,
                "cpuPercent": round(psutil.cpu_percent(interval=None)),
                "cpuCount": psutil.cpu_count() or 1,
                "memoryUsedBytes": memory.total - memory.available,
                "memoryTotalBytes": memory.total,
                "hugePagesTotal": 0,
                "hugePagesUsed": 0,
                "hugePagesReserved": 0,
                "hugePageSizeBytes": 0,
                "disks": [
                    {
                        "mountPoint": str(home),
                        "device": "",
                        "filesystemType": "",
                        "usedBytes": disk.used,
                        "totalBytes": disk.total,
                    }
                ],
            },
        }

    async def list(self, request: Request) -> Response:
        check_query(request)
        return JSONResponse([self._node()])
