"""A node's control plane without VMs, for gateway tests: the real internal gate, API-key gate
and list route over a real catalog, and create and adopt routes that accept or refuse as the
test says, or hold until it says so (an adopted record goes into the catalog, as a node's
`adopt` does; a create from a template it does not hold is a 404, as on a node), and a release
route that gives a sandbox up (paused, as a node's `release` leaves it). Its snapshots are
listed by the real route; it adopts and deletes them as a node's routes do. Its forks start as
many children as the test gives it room for and refuse the rest for capacity, and it snapshots
a sandbox on demand (the test publishes the snapshot, as a node's agent would once uploaded).
Its template build routes are a node's own (`aenv.api.builds`) over a real builder, short of
starting a build (which boots a VM), and an adopted template's tags go into its tag store, as a
node's `adopt_template` keeps them; its volume routes (and their content API) are a node's own
over a real volume store.
Booting VMs is what `test_gateway_cluster.py` does; these tests are about the gateway's choices."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from aenv.api.app import JSON_ERRORS, APIKeyGate
from aenv.api.builds import BuildRoutes
from aenv.api.errors import APIError, not_found
from aenv.api.events import EventRoutes
from aenv.api.extensions import BATCH_FORK, BULK_SANDBOXES, BULK_SNAPSHOTS, QUEUE, WAIT_HEADER
from aenv.api.internal_models import Refusal
from aenv.api.keys import KeyStore, LocalKeys
from aenv.api.limits import RateLimiter
from aenv.api.metrics import NodeMetrics
from aenv.api.requests import check_query
from aenv.api.sandboxes import SandboxRoutes, batch_metrics_ids, matching, metadata_filter
from aenv.api.snapshots import SnapshotRoutes
from aenv.api.templates import TemplateRoutes
from aenv.api.volumes import VolumeRoutes
from aenv.api.webhooks import WebhookRoutes
from aenv.cluster.internal import InternalGate
from aenv.config import Config, load
from aenv.network.settings import SandboxNetwork
from aenv.orchestrator.builds import Builder
from aenv.orchestrator.catalog import (
    Catalog,
    SandboxRecord,
    VolumeMount,
    record_from_json,
    record_to_json,
)
from aenv.orchestrator.events import EventLog
from aenv.orchestrator.kinds import SaveMode, TemplateKind
from aenv.orchestrator.lifecycle import Orchestrator
from aenv.orchestrator.reserve import HostReserve
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.tags import TagStore, without_tags
from aenv.orchestrator.templates import (
    Template,
    TemplateNotFound,
    TemplateStore,
    template_from_json,
    template_to_json,
)
from aenv.orchestrator.volumes import VolumeStore
from aenv.orchestrator.webhook_delivery import DeliverySettings, WebhookDispatcher
from aenv.orchestrator.webhooks import WebhookStore
from tests.cluster.shared import SECRET
from tests.doubles.volumes import DirectoryBacking


@dataclass
class _CatalogOnly:
    """What the list, build and volume routes read of the orchestrator: its catalog, volumes,
    snapshots, template store and configuration; the lists a builder joins."""

    catalog: Catalog
    volumes: VolumeStore
    saved: dict[str, Template]
    templates: TemplateStore
    config: Config
    chores: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    template_deleted: list[Callable[[str], Awaitable[None]]] = field(default_factory=list)

    def snapshots(self) -> list[Template]:
        return list(self.saved.values())


def snapshot(template_id: str, created_at: float, *names: str) -> Template:
    """A snapshot's record as a node keeps it, its copy in the repository."""
    return Template(
        template_id=template_id, build_id="b1", aliases=names, cpu_count=1, memory_mb=256,
        disk_size_mb=1024, envd_version="0.1", envd_access_token="tok", created_at=created_at,
        snapshot_dir=f"/nowhere/{template_id}/b1", kind=TemplateKind.SNAPSHOT,
        source_sandbox_id="sbsource", manifest_id=f"m-{template_id}",
    )  # fmt: skip


@dataclass
class NodeDouble:
    name: str
    home: Path
    catalog: Catalog
    # What the next creates answer, in order (a status, and the kind of its refusal where it is
    # not the one a node's routes say with that status); 201 once they run out.
    create_answers: list[int | tuple[int, Refusal]] = field(default_factory=list)
    creates_seen: list[str] = field(default_factory=list)  # the callers' key ids
    adopt_answers: list[int] = field(default_factory=list)  # as `create_answers`, 200 after
    unreleasable: set[str] = field(default_factory=set)  # sandboxes whose release is refused
    snapshots: dict[str, Template] = field(default_factory=dict)
    create_bodies: list[dict[str, Any]] = field(default_factory=list)
    create_waits: list[str | None] = field(default_factory=list)  # their X-Aenv-Wait headers
    fork_room: int = 100  # children a fork may start here; the others are refused (429)
    # While set and not open, creates wait for it (taken, not answered: a VM booting).
    create_gate: threading.Event | None = None
    # Called with each snapshot taken here, as its upload would end.
    on_snapshot: Callable[[Template], Awaitable[None]] | None = None
    builder: Builder | None = None  # set by `app`
    templates: TemplateStore | None = None  # set by `app`
    events: EventLog | None = None  # set by `app`
    webhooks: WebhookDispatcher | None = None  # set by `app`

    def add(
        self,
        sandbox_id: str,
        started_at: float,
        volume_mounts: tuple[VolumeMount, ...] = (),
        **metadata: str,
    ) -> None:
        self.catalog.insert(
            SandboxRecord(
                id=sandbox_id, template_id="base", state=SandboxState.RUNNING, cpu_count=1,
                memory_mb=256, disk_size_mb=1024, started_at=started_at,
                end_at=started_at + 300, metadata=metadata, env_vars={},
                envd_access_token="tok", restored_from="/t/base", timeout=300,
                auto_pause_mode=SaveMode.FILESYSTEM, network=SandboxNetwork(),
                volume_mounts=volume_mounts,
            )
        )  # fmt: skip

    def app(self, keys: KeyStore) -> ASGIApp:
        config = load({"home": self.home})
        templates = TemplateStore(config.paths.templates, self.home / "template-memory")
        self.templates = templates
        self.events = EventLog(self.catalog, templates, queue_limit=10)
        # Its webhooks' queue and log, never delivered from (nothing wakes it).
        self.webhooks = WebhookDispatcher(
            WebhookStore(self.catalog), DeliverySettings(1, 1.0, 1.0, False, ())
        )
        orchestrator = cast(
            Orchestrator,
            _CatalogOnly(
                self.catalog,
                VolumeStore(
                    self.catalog,
                    config.paths.volumes,
                    DirectoryBacking(config.paths.volumes),
                    HostReserve(self.home, config.reserve_disk_mb, config.reserve_memory_mb),
                    config.volume_size_mb,
                ),
                self.snapshots,
                templates,
                config,
            ),
        )
        self.builder = Builder(
            orchestrator, TagStore(config.paths.template_tags), config.paths, ready_timeout=1
        )
        routes = SandboxRoutes(orchestrator, config, cast(NodeMetrics, None))
        saved = SnapshotRoutes(orchestrator, config)
        templates_api = TemplateRoutes(orchestrator, self.builder)
        app = Starlette(
            routes=[
                Route("/sandboxes", self.create, methods=["POST"]),
                Route("/v2/sandboxes", routes.list_v2, methods=["GET"]),
                Route("/sandboxes/metrics", self.metrics, methods=["GET"]),
                Route("/sandboxes/{sandbox_id}", self.detail, methods=["GET"]),
                Route("/aenv/sandboxes/{sandbox_id}/reset", self.detail, methods=["POST"]),
                Route(BULK_SANDBOXES + "/kill", self.bulk_kill, methods=["POST"]),
                Route(BULK_SNAPSHOTS, self.bulk_delete_snapshots, methods=["DELETE"]),
                Route("/cluster/adopt", self.adopt, methods=["POST"]),
                Route("/cluster/sandboxes/{sandbox_id}/release", self.release, methods=["POST"]),
                Route("/snapshots", saved.list_snapshots, methods=["GET"]),
                Route("/sandboxes/{sandbox_id}/fork", self.fork, methods=["POST"]),
                Route(BATCH_FORK, self.fork, methods=["POST"]),
                Route("/sandboxes/{sandbox_id}/snapshots", self.snapshot, methods=["POST"]),
                Route("/cluster/templates", self.adopt_template, methods=["POST"]),
                # Before the template routes, as on a node: `/templates/tags` is not an id.
                *BuildRoutes(self.builder).routes(),
                Route("/templates/{template_id}", self.delete_template, methods=["DELETE"]),
                Route("/templates", templates_api.list, methods=["GET"]),
                Route("/templates/aliases/{alias}", templates_api.alias, methods=["GET"]),
                Route("/templates/{template_id}", templates_api.get, methods=["GET"]),
                *VolumeRoutes(orchestrator).routes(),
                Route(QUEUE, self.queue, methods=["GET"]),
                *EventRoutes(self.events).routes(),
                *WebhookRoutes(self.webhooks).routes(),
            ],
            exception_handlers=JSON_ERRORS,
        )
        return InternalGate(APIKeyGate(app, LocalKeys(keys), RateLimiter(1000, 1000)), SECRET)

    async def create(self, request: Request) -> Response:
        self.creates_seen.append(request.state.api_key.id)
        sandbox_id = f"{self.name}sb{len(self.creates_seen)}"
        body = await request.json()
        self.create_bodies.append(body)
        self.create_waits.append(request.headers.get(WAIT_HEADER))
        ref = str(body.get("templateID", "base"))
        if not self.knows(ref):
            raise not_found(f"template '{ref}'")
        if self.create_gate is not None:
            await asyncio.to_thread(self.create_gate.wait, 60)
        answer = self.create_answers.pop(0) if self.create_answers else 201
        if answer != 201:
            raise self.refusing(answer)
        self.add(sandbox_id, time.time())
        return JSONResponse({"sandboxID": sandbox_id, "node": self.name}, status_code=201)

    def refusing(self, answer: int | tuple[int, Refusal]) -> APIError:
        """A refusal with the status a test gives, of the kind a node's routes say with it
        unless the test gives one."""
        if isinstance(answer, tuple):
            status, kind = answer
        else:
            status = answer
            kinds = {429: Refusal.FULL, 404: Refusal.NOT_HERE}
            kind = kinds.get(status, Refusal.FAILED if status >= 500 else Refusal.REJECTED)
        return APIError(status, f"{self.name} refuses", refusal=kind)

    async def queue(self, _: Request) -> Response:
        """A node's `GET /aenv/queue`: a double's creates never wait."""
        return JSONResponse({"waiting": 0, "positions": [], "maxWait": 0})

    async def metrics(self, request: Request) -> Response:
        """A sample naming this node for each running sandbox here, as a node leaves out the
        others."""
        ids = batch_metrics_ids(request)
        found = {
            i: {"node": self.name}
            for i in ids
            if (r := self.catalog.get(i)) and r.state.public == "running"
        }
        return JSONResponse({"sandboxes": found})

    async def bulk_kill(self, request: Request) -> Response:
        """The bulk kill by metadata, on this node's rows (no VMs here)."""
        selected = matching(self.catalog.list(), _bulk_filter(request))
        for record in selected:
            self.catalog.delete(record.id)
        return JSONResponse({"sandboxes": [{"sandboxID": r.id} for r in selected]})

    async def bulk_delete_snapshots(self, request: Request) -> Response:
        """The bulk delete of snapshots by metadata, of those this node holds."""
        selected = matching(list(self.snapshots.values()), _bulk_filter(request))
        for made in selected:
            del self.snapshots[made.template_id]
        return JSONResponse({"snapshots": [{"snapshotID": t.template_id} for t in selected]})

    async def detail(self, request: Request) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        record = self.catalog.get(sandbox_id)
        if record is None:
            raise not_found(f"sandbox '{sandbox_id}'")
        mounts = [{"name": m.volume_id, "path": m.path} for m in record.volume_mounts]
        body = {"sandboxID": sandbox_id, "node": self.name}
        return JSONResponse({**body, "volumeMounts": mounts} if mounts else body)

    async def adopt(self, request: Request) -> Response:
        status = self.adopt_answers.pop(0) if self.adopt_answers else 200
        if status != 200:
            raise self.refusing(status)
        record = record_from_json((await request.body()).decode())
        self.catalog.insert(record)
        return Response(record_to_json(record), media_type="application/json")

    async def release(self, request: Request) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        record = self.catalog.get(sandbox_id)
        if record is None or sandbox_id in self.unreleasable:
            raise APIError(409, f"{sandbox_id} cannot move")
        self.catalog.delete(sandbox_id)
        return Response(record_to_json(record), media_type="application/json")

    async def adopt_template(self, request: Request) -> Response:
        record, tags = without_tags((await request.body()).decode())
        template = template_from_json(record)
        self.snapshots[template.template_id] = template
        assert self.builder is not None
        self.builder.tags.take(template.template_id, tags)
        return Response(template_to_json(template), media_type="application/json")

    def knows(self, ref: str) -> bool:
        """Whether a create may start from `ref` here, as a node's template store says: `base`
        (every node has it), or a template or snapshot it holds or adopted, by id or name."""
        name = ref.split(":", 1)[0]
        if name == "base" or any(
            name == t.template_id or name in t.aliases for t in self.snapshots.values()
        ):
            return True
        assert self.templates is not None
        try:
            self.templates.get(name)
        except TemplateNotFound:
            return False
        return True

    def holds(self, template: Template) -> None:
        """Has the template's files, as after building or pulling it."""
        assert self.templates is not None
        (self.templates.directory / template.template_id).mkdir(parents=True)
        self.templates.save(template)

    async def delete_template(self, request: Request) -> Response:
        template_id = request.path_params["template_id"]
        if self.snapshots.pop(template_id, None) is None:
            raise not_found(f"template '{template_id}'")
        return Response(status_code=204)

    async def fork(self, request: Request) -> Response:
        body = await request.json()
        count = len(body["children"]) if "children" in body else body.get("count", 1)
        entries: list[dict[str, Any]] = []
        for index in range(count):
            if index < self.fork_room:
                child = f"{self.name}child{len(self.catalog.list())}"
                self.add(child, time.time())
                entries.append({"sandbox": {"sandboxID": child, "node": self.name}})
            else:
                entries.append({"error": {"code": 429, "message": f"{self.name} is full"}})
        return JSONResponse(entries, status_code=201)

    async def snapshot(self, request: Request) -> Response:
        made = snapshot(f"snapof{request.path_params['sandbox_id']}", time.time())
        self.snapshots[made.template_id] = made
        if self.on_snapshot is not None:
            await self.on_snapshot(made)
        return JSONResponse({"snapshotID": made.template_id, "names": []}, status_code=201)


def _bulk_filter(request: Request) -> dict[str, str]:
    """A bulk route's filter, refused when empty as a node's own routes refuse it."""
    check_query(request, {"metadata"})
    wanted = metadata_filter(request)
    if not wanted:
        raise APIError(400, "metadata: a filter is required")
    return wanted
