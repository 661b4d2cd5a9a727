"""A cluster node on the doubles in a process of its own, until SIGTERM: the real API,
orchestrator, catalog, internal gate and heartbeats (`aenv node` short of VMs), on loopback.

Run as a script with the `aenv` and `tests` packages of any release on `PYTHONPATH`, so a test
runs the previous release's node beside this one's (`test_rolling_upgrade.py`); it uses only
what both have. Settings come from the environment: `AENV_HOME`, `AENV_PORT`,
`AENV_REDIS_URL`, `AENV_CLUSTER_SECRET`, `AENV_NODE_ID`. Every request it takes is written to
`$AENV_HOME/requests.log` (`METHOD path`, one a line), for the test to see what gateways sent.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from aenv.api.app import create_api, node_builder
from aenv.api.keys import KeyStore
from aenv.cluster.internal import InternalGate
from aenv.cluster.membership import NodeSettings, membership
from aenv.cluster.source import CatalogSource
from tests.doubles.node import double_node


async def main() -> None:
    home, port = Path(os.environ["AENV_HOME"]), int(os.environ["AENV_PORT"])
    settings: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": port,
        "redis_url": os.environ["AENV_REDIS_URL"],
        "cluster_secret": os.environ["AENV_CLUSTER_SECRET"],
        "node_id": os.environ["AENV_NODE_ID"],
        "heartbeat_interval": 0.5,
        "lease_ttl": 5.0,
    }
    async with double_node(home, **settings) as node:
        member = NodeSettings.of(node.config)
        keys = KeyStore(node.config.paths.api_key.with_suffix(".json"))
        builder = node_builder(node.orchestrator, node.config)
        api = create_api(node.orchestrator, node.config, keys, builder)
        app = _Logged(InternalGate(api, member.secret), home / "requests.log")
        source = CatalogSource(
            node.catalog, node.orchestrator.templates, node.orchestrator.forget, builder
        )
        async with membership(member, source) as agent:
            node.orchestrator.residency.append(agent)
            config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off")
            await uvicorn.Server(config).serve()
            node.orchestrator.residency.remove(agent)


class _Logged:
    def __init__(self, app: ASGIApp, log: Path) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            with self.log.open("a") as log:
                log.write(f"{scope['method']} {scope['path']}\n")
        await self.app(scope, receive, send)


if __name__ == "__main__":
    asyncio.run(main())
