"""Sandbox routes of the E2B control plane (v1 and v2), with the SDKs' exact status codes."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar
from urllib.parse import parse_qsl, unquote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, call_lifecycle, not_found
from aenv.api.idempotency import HEADER as IDEMPOTENCY_HEADER
from aenv.api.idempotency import IdempotentCreates, check_key
from aenv.api.internal import CURSORS_HEADER, caller
from aenv.api.internal_models import Refusal
from aenv.api.limits import wait_of
from aenv.api.metrics import NodeMetrics
from aenv.api.models import (
    DEFAULT_TIMEOUT_V1,
    DEFAULT_TIMEOUT_V2,
    MAX_SECONDS,
    ConnectBody,
    NetworkUpdate,
    NewSandbox,
    RefreshBody,
    TimeoutBody,
    check_metadata,
)
from aenv.api.network import create_network, identity_tokens, network_info, updated_network
from aenv.api.queue import Waiting, client_gone
from aenv.api.requests import check_query, not_supported, parse_body
from aenv.api.scope import Caller, team_of
from aenv.api.volumes import mounts_body, resolve_mounts
from aenv.config import Config
from aenv.envd import ENVD_VERSION
from aenv.network.identity import NO_TOKENS
from aenv.network.settings import SandboxNetwork
from aenv.orchestrator.build_records import Build
from aenv.orchestrator.catalog import PageQuery, SandboxRecord
from aenv.orchestrator.envd_client import EnvdUnavailable
from aenv.orchestrator.kinds import SaveMode
from aenv.orchestrator.lifecycle import (
    CapacityReached,
    CreateFailed,
    CreateRequest,
    InvalidNetwork,
    Orchestrator,
    SandboxNotFound,
)
from aenv.orchestrator.metrics_history import Sample
from aenv.orchestrator.states import LIVE, with_public
from aenv.orchestrator.templates import TemplateNotFound
from aenv.orchestrator.volumes import VolumeNotFound


class _Labelled(Protocol):
    @property
    def metadata(self) -> Mapping[str, str]: ...


M = TypeVar("M", bound=_Labelled)

CLIENT_ID = "6532622b"  # the legacy constant infra sends; SDKs require the key
MAX_PAGE = 100
_LIST_V2_QUERY = frozenset(
    {"metadata", "state", "order", "startedAfter", "template", "nextToken", "limit"}
)


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def sandbox_body(record: SandboxRecord, config: Config) -> dict[str, Any]:
    """The `Sandbox` schema: what create, connect, resume and fork answer."""
    body: dict[str, Any] = {
        "templateID": record.template_id,
        "sandboxID": record.id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": record.envd_access_token,
        "trafficAccessToken": record.traffic_access_token,
        "domain": config.domain,
    }
    if record.alias:
        body["alias"] = record.alias
    return body


class SandboxRoutes:
    def __init__(
        self,
        orchestrator: Orchestrator,
        config: Config,
        metrics: NodeMetrics,
        unfinished: Callable[[str], Build | None] = lambda name: None,
    ) -> None:
        self.orc = orchestrator
        self.config = config
        self.node_metrics = metrics
        # The unfinished build of a template not ready yet (`Builder.unfinished`).
        self.unfinished = unfinished
        self.creates = IdempotentCreates()

    def routes(self) -> list[Route]:
        return [
            Route("/sandboxes", self.create_v1, methods=["POST"]),
            Route("/v2/sandboxes", self.create_v2, methods=["POST"]),
            Route("/sandboxes", self.list_v1, methods=["GET"]),
            Route("/v2/sandboxes", self.list_v2, methods=["GET"]),
            # Before the sandbox routes: `metrics` is not a sandbox id.
            Route("/sandboxes/metrics", self.batch_metrics, methods=["GET"]),
            Route("/sandboxes/{sandbox_id}", self.detail, methods=["GET"]),
            Route("/sandboxes/{sandbox_id}", self.kill, methods=["DELETE"]),
            Route("/sandboxes/{sandbox_id}/timeout", self.timeout, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/refreshes", self.refresh, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/connect", self.connect, methods=["POST"]),
            Route("/v2/sandboxes/{sandbox_id}/connect", self.connect, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/metrics", self.metrics, methods=["GET"]),
            Route("/sandboxes/{sandbox_id}/network", self.update_network, methods=["PUT"]),
        ]

    # -- shapes ---------------------------------------------------------------------------

    def _sandbox(self, record: SandboxRecord) -> dict[str, Any]:
        return sandbox_body(record, self.config)

    def _listed(self, record: SandboxRecord) -> dict[str, Any]:
        body: dict[str, Any] = {
            "templateID": record.template_id,
            "sandboxID": record.id,
            "clientID": CLIENT_ID,
            "startedAt": rfc3339(record.started_at),
            "endAt": rfc3339(record.end_at),
            "cpuCount": record.cpu_count,
            "memoryMB": record.memory_mb,
            "diskSizeMB": record.disk_size_mb,
            "state": record.state.public,
            "envdVersion": ENVD_VERSION,
            "metadata": dict(record.metadata),
            "volumeMounts": mounts_body(self.orc.volumes, record),
        }
        if record.alias:
            body["alias"] = record.alias
        return body

    def _detail(self, record: SandboxRecord) -> dict[str, Any]:
        return {
            **self._listed(record),
            "envdAccessToken": record.envd_access_token,
            "allowInternetAccess": record.network.allow_internet,
            "network": network_info(record.network),
            "domain": self.config.domain,
            "lifecycle": {
                "autoResume": record.auto_resume,
                "onTimeout": "pause" if record.auto_pause else "kill",
            },
            "pauseMode": record.auto_pause_mode.value,
        }

    # -- create ---------------------------------------------------------------------------

    async def _create(self, request: Request, default_timeout: int) -> Response:
        check_query(request)
        body = await parse_body(request, NewSandbox)
        if body.secure is False:
            # Every envd here requires the access token; an open envd is not offered.
            raise not_supported("secure")
        timeout = default_timeout if body.timeout is None else body.timeout
        if timeout <= 0 or timeout > self.config.max_timeout:
            raise APIError(400, f"timeout must be between 1 and {self.config.max_timeout} seconds")
        owner = Caller(request.state.api_key.id, team_of(request))
        wait = wait_of(request)
        key = request.headers.get(IDEMPOTENCY_HEADER)
        async with client_gone(request, wait) as gone:
            waiting = Waiting(wait, gone)
            if key is None:
                made = await self._start(body, timeout, owner, waiting)
            else:
                scope = (owner.key_id, check_key(key))
                request_json = f"{timeout} {body.model_dump_json()}"
                made = await self.creates.once(
                    scope,
                    request_json,
                    lambda: self._start(body, timeout, owner, waiting),
                    self._lives,
                )
        return JSONResponse(made, status_code=201)

    def _lives(self, made: dict[str, Any]) -> bool:
        try:
            self.orc.get(made["sandboxID"])
        except SandboxNotFound:
            return False
        return True

    async def _checked(self, network: SandboxNetwork) -> SandboxNetwork:
        try:
            await self.orc.check_network(network)
        except InvalidNetwork as e:
            raise APIError(400, f"network.{e.field}: {e}") from e
        return network

    async def _start(
        self, body: NewSandbox, timeout: int, owner: Caller, waiting: Waiting
    ) -> dict[str, Any]:
        iam = identity_tokens(body.iam)
        network = create_network(body.allow_internet_access, body.network, iam)
        network = await self._checked(network)
        volume_mounts = resolve_mounts(self.orc.volumes, body.volume_mounts, owner.team_id)
        try:
            with self.node_metrics.create_seconds.time():
                record, _ = await self.orc.create(
                    CreateRequest(
                        template=unquote(body.template_id),
                        timeout=timeout,
                        metadata=body.metadata or {},
                        env_vars=body.env_vars or {},
                        auto_pause=body.auto_pause,
                        auto_pause_mode=SaveMode.of(body.auto_pause_memory),
                        auto_resume=body.auto_resume is not None and body.auto_resume.enabled,
                        network=network,
                        owner=owner.key_id,
                        team_id=owner.team_id,
                        volume_mounts=volume_mounts,
                        wait=waiting.wait,
                        gone=waiting.gone,
                    )
                )
        except TemplateNotFound as e:
            build = self.unfinished(unquote(body.template_id))
            if build is not None:
                # E2B's answer for a template whose first build has not finished.
                raise APIError(
                    404,
                    f"template '{body.template_id}' ({build.template_id}) has no ready build:"
                    f" build {build.build_id} is {build.status}, retry when it is ready",
                    refusal=Refusal.NOT_HERE,
                ) from e
            raise not_found(f"template '{body.template_id}'") from e
        except CapacityReached as e:
            raise APIError(
                429, str(e), error_code="sandbox_capacity_unavailable", refusal=Refusal.FULL
            ) from e
        except VolumeNotFound as e:  # deleted since it was resolved above
            raise APIError(400, f"volumeMounts: {e}") from e
        except CreateFailed as e:
            raise APIError(
                500,
                str(e),
                error_code="sandbox_create_failed",
                should_retry=False,
                refusal=Refusal.FAILED,
            ) from e
        return self._sandbox(record)

    async def create_v1(self, request: Request) -> Response:
        return await self._create(request, DEFAULT_TIMEOUT_V1)

    async def create_v2(self, request: Request) -> Response:
        return await self._create(request, DEFAULT_TIMEOUT_V2)

    # -- list -----------------------------------------------------------------------------

    async def list_v1(self, request: Request) -> Response:
        check_query(request, {"metadata"})
        team = team_of(request)
        running = [r for r in self.orc.list() if r.state.public == "running" and r.team_id == team]
        return JSONResponse([self._listed(r) for r in _filter_metadata(running, request)])

    async def list_v2(self, request: Request) -> Response:
        check_query(request, _LIST_V2_QUERY)
        q = request.query_params
        states = {s for s in q.get("state", "").split(",") if s} or {"running", "paused"}
        unknown = states - {"running", "paused"}
        if unknown:
            raise APIError(400, f"unknown state filter: {', '.join(sorted(unknown))}")
        limit = _int_param(q.get("limit"), MAX_PAGE, "limit")
        if not 1 <= limit <= MAX_PAGE:
            raise APIError(400, f"limit must be between 1 and {MAX_PAGE}")
        ascending = q.get("order", "desc").lower() == "asc"
        started_after = q.get("startedAfter")
        token = q.get("nextToken")
        query = PageQuery(
            states=frozenset().union(*(with_public(s) for s in states)),
            limit=limit,
            team_id=team_of(request),
            metadata=metadata_filter(request),
            template=q.get("template") or None,
            started_after=_parse_time(started_after) if started_after else None,
            ascending=ascending,
            after=cursor_key(token) if token else None,
        )
        page, more = self.orc.catalog.page(query)
        headers = {"X-Next-Token": cursor(page[-1], ascending)} if more and page else {}
        if caller(request.scope.get("state", {})) is not None:
            # A gateway merges several nodes' pages: it needs every item's exact position.
            headers[CURSORS_HEADER] = ",".join(cursor(r, ascending) for r in page)
        return JSONResponse([self._listed(r) for r in page], headers=headers)

    # -- single sandbox ---------------------------------------------------------------------

    def _record(self, request: Request, query: Collection[str] = ()) -> SandboxRecord:
        """The sandbox the path names; the route honours the `query` parameters only."""
        check_query(request, query)
        sandbox_id = request.path_params["sandbox_id"]
        try:
            return self.orc.get(sandbox_id)
        except SandboxNotFound as e:
            raise not_found(f"sandbox '{sandbox_id}'") from e

    async def detail(self, request: Request) -> Response:
        return JSONResponse(self._detail(self._record(request)))

    async def kill(self, request: Request) -> Response:
        check_query(request)
        sandbox_id = request.path_params["sandbox_id"]
        if not await self.orc.kill(sandbox_id):
            raise not_found(f"sandbox '{sandbox_id}'")
        return Response(status_code=204)

    async def timeout(self, request: Request) -> Response:
        check_query(request)
        body = await parse_body(request, TimeoutBody)
        record = self._record(request)
        if body.timeout > self.config.max_timeout:
            raise APIError(400, f"timeout must be at most {self.config.max_timeout} seconds")
        self.orc.set_timeout(record.id, body.timeout)
        return Response(status_code=204)

    async def refresh(self, request: Request) -> Response:
        check_query(request)
        body = await parse_body(request, RefreshBody, optional=True)
        record = self._record(request)
        self.orc.extend_timeout(record.id, body.duration or DEFAULT_TIMEOUT_V1)
        return Response(status_code=204)

    async def connect(self, request: Request) -> Response:
        """200 with the running sandbox (its timeout only grows), 201 when it was resumed."""
        check_query(request)
        body = await parse_body(request, ConnectBody, optional=True)
        sandbox_id = request.path_params["sandbox_id"]
        timeout = body.timeout or DEFAULT_TIMEOUT_V2
        if timeout > self.config.max_timeout:
            raise APIError(400, f"timeout must be at most {self.config.max_timeout} seconds")
        record, resumed = await call_lifecycle(
            self.orc.connect(sandbox_id, timeout, mode=SaveMode.of(body.memory)), sandbox_id
        )
        return JSONResponse(self._sandbox(record), status_code=201 if resumed else 200)

    async def update_network(self, request: Request) -> Response:
        """Replace the egress rules of a running or paused sandbox: 204, 404, 409 mid-change."""
        check_query(request)
        body = await parse_body(request, NetworkUpdate)
        sandbox_id = request.path_params["sandbox_id"]
        # The tokens a sandbox may name are those it was created with: they never change. The
        # body of an unknown sandbox is judged alone (a bad one is a 400 still), then 404s.
        try:
            iam = self.orc.get(sandbox_id).network.iam
        except SandboxNotFound:
            iam = NO_TOKENS
        rules = await self._checked(updated_network(body, iam))
        await call_lifecycle(self.orc.set_egress(sandbox_id, rules), sandbox_id)
        return Response(status_code=204)

    async def metrics(self, request: Request) -> Response:
        """The samples between `start` and `end` (Unix seconds, inclusive), oldest first: the
        history the orchestrator samples while the sandbox runs (kept while it is paused), and
        when the range holds now and the newest is older than the sampling interval, a fresh
        sample first (so a sandbox just created has one)."""
        record = self._record(request, {"start", "end"})
        q = request.query_params
        start = _int_param(q.get("start"), 0, "start")
        end = _int_param(q.get("end"), MAX_SECONDS, "end")
        history = self.orc.metrics
        now = time.time()
        latest = history.latest(record.id)
        stale = latest is None or now - latest.ts >= history.interval
        # A hibernated sandbox has no VM to sample (and is not woken for it): its history only.
        if record.state in LIVE and start <= int(now) <= end and stale:
            try:
                await self.orc.sample_now(record.id)
            except (SandboxNotFound, EnvdUnavailable) as e:
                raise APIError(502, f"metrics unavailable: {e}") from e
        return JSONResponse([_metric(s) for s in history.between(record.id, start, end)])

    async def batch_metrics(self, request: Request) -> Response:
        """`SandboxesWithMetrics`: the current sample of each running sandbox among
        `sandbox_ids`; unknown, paused and unanswering ones are left out, as E2B leaves out
        what is not running."""
        ids = batch_metrics_ids(request)
        team = team_of(request)
        samples = await asyncio.gather(*(self._current_sample(i, team) for i in ids))
        found = {i: sample for i, sample in zip(ids, samples, strict=True) if sample is not None}
        return JSONResponse({"sandboxes": found})

    async def _current_sample(self, sandbox_id: str, team_id: str) -> dict[str, Any] | None:
        """The newest sample of the history when it is younger than the sampling interval,
        else one taken now; None for another team's sandbox, as for an unknown one."""
        record = self.orc.catalog.get(sandbox_id)
        if record is None or record.team_id != team_id or record.state.public != "running":
            return None
        latest = self.orc.metrics.latest(sandbox_id)
        if latest is not None and time.time() - latest.ts < self.orc.metrics.interval:
            return _metric(latest)
        try:
            return _metric(await self.orc.sample_now(sandbox_id))
        except (SandboxNotFound, EnvdUnavailable):
            return None  # stopped meanwhile, or its envd does not answer


def batch_metrics_ids(request: Request) -> list[str]:
    """The sandboxes a `/sandboxes/metrics` request names, once each; 400 for a bad query."""
    check_query(request, {"sandbox_ids"})
    wanted = request.query_params.get("sandbox_ids", "").split(",")
    ids = list(dict.fromkeys(i for i in wanted if i))
    if not 1 <= len(ids) <= MAX_PAGE:
        raise APIError(400, f"sandbox_ids must name between 1 and {MAX_PAGE} sandboxes")
    return ids


def _metric(taken: Sample) -> dict[str, Any]:
    """envd's sample as E2B's `SandboxMetric`."""
    ts, sample = int(taken.ts), taken.values
    return {
        "timestamp": rfc3339(ts),
        "timestampUnix": ts,
        "cpuCount": int(sample["cpu_count"]),
        "cpuUsedPct": float(sample["cpu_used_pct"]),
        "memUsed": int(sample["mem_used"]),
        "memTotal": int(sample["mem_total"]),
        "memCache": int(sample.get("mem_cache", 0)),
        "diskUsed": int(sample["disk_used"]),
        "diskTotal": int(sample["disk_total"]),
    }


def metadata_filter(request: Request) -> dict[str, str]:
    """`metadata=k%3Dv%26k2%3Dv2`: decoded as infra does (query decode, unescape, split).
    Bounded as sandboxes' metadata is: a longer filter matches nothing, and one query term per
    entry would exceed what SQLite parses."""
    raw = request.query_params.get("metadata")
    wanted = dict(parse_qsl(unquote(raw), keep_blank_values=True)) if raw else {}
    try:
        return check_metadata(wanted)
    except ValueError as e:
        raise APIError(400, f"metadata filter: {e}") from e


def _filter_metadata(records: Iterable[SandboxRecord], request: Request) -> Iterable[SandboxRecord]:
    return matching(records, metadata_filter(request))


def matching(records: Iterable[M], wanted: Mapping[str, str]) -> list[M]:
    """The sandboxes (or saved states) whose metadata holds every entry of `wanted`."""
    return [r for r in records if all(r.metadata.get(k) == v for k, v in wanted.items())]


def _parse_time(value: str) -> float:
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError as e:
        raise APIError(400, f"invalid time '{value}': use RFC 3339") from e


def _int_param(value: str | None, default: int, name: str) -> int:
    if value is None:
        return default
    try:
        return int(value)
    except ValueError as e:
        raise APIError(400, f"{name} must be an integer") from e


def cursor(record: SandboxRecord, ascending: bool) -> str:
    """`nextToken` for the page after `record`: its position, valid on every node (a gateway
    passes one token to all of them)."""
    raw = f"{record.started_at!r}__{record.id}__{'asc' if ascending else 'desc'}"
    return base64.urlsafe_b64encode(raw.encode()).decode()


def cursor_key(token: str) -> tuple[float, str]:
    """The (started at, sandbox id) position a `nextToken` names; 400 when it names none."""
    try:
        started, sandbox_id, _ = base64.urlsafe_b64decode(token.encode()).decode().split("__")
        return float(started), sandbox_id
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, "invalid nextToken") from e
