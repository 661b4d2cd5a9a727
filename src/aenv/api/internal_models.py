"""The gateway -> node internal API, version 1: its versions, its calls and the one answer
they all get, with the kind of a refusal said in the answer's body.

A node serves it under `/internal/v1/...` (`aenv.api.internal_v1`); a gateway calls it
(`aenv.gateway.nodes`) when the node's report names version 1 among its `internal_versions`.
Version 0 is the replay of E2B requests under `/internal` that every node still serves: the
gateway of the previous release speaks only that, and a gateway still uses it for what version 1
does not carry (uploads of a build's files, volumes' content, the data plane).

Each call names an operation (a create of a sandbox or a volume, an operation on a sandbox or a
template, an adoption), not a URL: the node runs it through its own E2B route (so it is
validated and answered exactly as that route answers a client) and answers `NodeAnswer`: the
E2B answer (status, headers, body verbatim), and when the node did not do it, why
(`Refusal`). The gateway passes the E2B answer on or, for a refusal that another node could
avoid (full, draining, not here), tries another node: it never guesses from a status code.

The calls carrying an E2B request's query and body as they are (`E2BCall`) are declared once,
with the E2B route each is run through, in `FAMILIES` and `SINGLES`: a node serves its
version 1 routes from them, and a gateway recognises in them the E2B requests it sends as
version 1 calls. The others (a create, batch metrics, an adoption) have fields of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Generic, Self, TypeVar

from pydantic import BaseModel, ConfigDict

from aenv.api.extensions import BATCH_FORK, BULK_SANDBOXES, RESET

# Version 0: E2B requests replayed under `/internal` (deprecated; served for one more release).
REPLAY = 0
# The versions this code speaks, as a node (in its report) and as a gateway.
INTERNAL_VERSIONS = (REPLAY, 1)
PREFIX_V1 = "/v1"  # under the internal prefix (`aenv.cluster.internal.PREFIX`)


class Refusal(StrEnum):
    """Why a node did not do what it was asked; nothing of the call is left on the node."""

    FULL = "full"  # no room for another sandbox (or volume): another node may have some
    DRAINING = "draining"  # the node takes no new sandboxes
    NOT_HERE = "not-here"  # the sandbox, template or volume named is not on this node
    REJECTED = "rejected"  # the request is wrong anywhere: its E2B error is the client's answer
    FAILED = "failed"  # the node tried and failed (or erred): another node may try a create


class E2BApi(StrEnum):
    """Which of E2B's create routes a create came through: they differ in default timeout."""

    V1 = "v1"
    V2 = "v2"


class SandboxOp(StrEnum):
    """What a gateway asks of a node about one of its sandboxes."""

    INFO = "info"
    KILL = "kill"
    PAUSE = "pause"
    RESUME = "resume"
    CONNECT = "connect"
    TIMEOUT = "timeout"
    REFRESH = "refresh"
    SNAPSHOT = "snapshot"
    FORK = "fork"
    NETWORK = "network"  # replace its egress rules
    LOGS = "logs"  # its console's lines, paged by the query
    LOGS_V2 = "logs-v2"  # E2B's v2 shape of them
    METRICS = "metrics"  # its samples over the query's range
    EVENTS = "events"  # its lifecycle events, paged by the query
    RELEASE = "release"  # give the sandbox up, paused, for another node to adopt
    RESET = "reset"  # this node's extension: back to a snapshot's state, in place
    BATCH_FORK = "batch-fork"  # this node's extension: children with labels of their own


class TemplateOp(StrEnum):
    """What a gateway asks of a node about a template (or snapshot) it may hold."""

    INFO = "info"  # with its builds, paged by the query
    ALIAS = "alias"  # looked up by its name
    UPDATE = "update"
    DELETE = "delete"
    TAGS = "tags"


class BuildOp(StrEnum):
    """What a gateway asks of the node running a template's build."""

    START = "start"  # its steps
    STATUS = "status"  # with a page of its log
    LOGS = "logs"


class VolumeOp(StrEnum):
    """What a gateway asks of the node a volume lives on."""

    INFO = "info"
    DELETE = "delete"


class TagOp(StrEnum):
    """A change of a template's tags, which a gateway sends to every node."""

    ASSIGN = "assign"
    DELETE = "delete"


class ListOp(StrEnum):
    """The lists a gateway merges from every live node."""

    SANDBOXES = "sandboxes"  # E2B's unpaged v1 list
    SANDBOXES_V2 = "sandboxes-v2"  # paged, with each sandbox's cursor (`CURSORS_HEADER`)
    SNAPSHOTS = "snapshots"
    TEMPLATES = "templates"
    TEMPLATES_V2 = "templates-v2"
    VOLUMES = "volumes"
    EVENTS = "events"  # the lifecycle events of the caller's sandboxes


class BulkOp(StrEnum):
    """This node's bulk operations on the sandboxes a metadata filter selects, which a gateway
    sends to every live node."""

    KILL = "kill"
    PAUSE = "pause"
    TIMEOUT = "timeout"


class AdoptKind(StrEnum):
    SANDBOX = "sandbox"  # a paused sandbox another node released or lost
    TEMPLATE = "template"  # a snapshot or built template stored in the shared repository


class _Call(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class E2BCall(_Call):
    """A call run as one E2B request, carrying that request's query string and body verbatim
    in its fields `query` and `body` (those of the two it has)."""

    @classmethod
    def carrying(cls, query: str, body: str) -> Self | None:
        """The call carrying `query` and `body`; None when it has no field for one given."""
        given = {"query": query, "body": body}
        if any(value and name not in cls.model_fields for name, value in given.items()):
            return None
        return cls(**{name: value for name, value in given.items() if name in cls.model_fields})

    def e2b(self) -> tuple[str, str]:
        """The query string and the body of the E2B request the call is run as."""
        return str(getattr(self, "query", "")), str(getattr(self, "body", ""))


class CreateSandbox(_Call):
    """`POST /internal/v1/sandboxes`."""

    api: E2BApi
    # The client's E2B body, verbatim: the node validates it as its public route does.
    body: str
    idempotency_key: str | None = None
    # The client's `X-Aenv-Wait` header, verbatim: the node reads it as its public route does.
    wait: str | None = None


class CreateVolume(E2BCall):
    """`POST /internal/v1/volumes`."""

    body: str  # the client's E2B body, verbatim


class SandboxCall(E2BCall):
    """`POST /internal/v1/sandboxes/{id}/{op}` (`SandboxOp`)."""

    query: str = ""  # the client's query string, verbatim (a page of logs, a range of metrics)
    body: str = ""  # the client's E2B body, verbatim (none for info, kill and release)


class TemplateCall(E2BCall):
    """`POST /internal/v1/templates/{id}/{op}` (`TemplateOp`)."""

    query: str = ""  # the client's query string, verbatim (a template's builds are paged)
    body: str = ""  # the client's E2B body, verbatim (an update's)


class RequestBuild(E2BCall):
    """`POST /internal/v1/builds`: a template build asked for, to be started by `BuildOp.START`
    once its files are uploaded."""

    body: str  # the client's E2B body, verbatim


class BuildCall(E2BCall):
    """`POST /internal/v1/templates/{id}/builds/{build}/{op}` (`BuildOp`)."""

    query: str = ""  # the client's query string, verbatim (a status's or log's page)
    body: str = ""  # the client's E2B body, verbatim (a start's steps)


class FilesCall(E2BCall):
    """`POST /internal/v1/templates/{id}/files/{hash}`: whether the node has a build
    step's files (a `COPY`'s tar, by its hash), and where to upload them."""


class VolumeCall(E2BCall):
    """`POST /internal/v1/volumes/{id}/{op}` (`VolumeOp`)."""


class TagCall(E2BCall):
    """`POST /internal/v1/tags/{op}` (`TagOp`)."""

    body: str  # the client's E2B body, verbatim (it names the template)


class ListCall(E2BCall):
    """`POST /internal/v1/lists/{op}` (`ListOp`)."""

    query: str = ""  # the client's query string, verbatim (filters, page size, token)


class BulkCall(E2BCall):
    """`POST /internal/v1/bulk/{op}` (`BulkOp`)."""

    query: str = ""  # the client's query string, verbatim (its `metadata` filter)
    body: str = ""  # the client's E2B body, verbatim (a timeout's)


class DeliveriesCall(E2BCall):
    """`POST /internal/v1/webhooks/{id}/deliveries`: the node's log of its deliveries of a
    webhook, which a gateway merges from every node."""

    query: str = ""  # the client's query string, verbatim (a limit, states)


class Metrics(_Call):
    """`POST /internal/v1/metrics`: the latest sample of each of these sandboxes the node
    runs (those it does not run are left out of its answer)."""

    sandbox_ids: list[str]


class Adopt(_Call):
    """`POST /internal/v1/adopt/{kind}` (`AdoptKind`)."""

    # The record as its publisher wrote it (`catalog.record_to_json`, or `tags.with_tags`).
    record: str


class NodeAnswer(BaseModel):
    """The answer to every version 1 call (HTTP 200; a malformed call is a 400 JSON error)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    refusal: Refusal | None = None  # None: done
    status: int  # the E2B answer's, which a client of the node's public route would get
    headers: list[tuple[str, str]] = []
    body: str = ""


# Each operation as the E2B route (method, path under `{id}`) a node runs it through. Its
# version 0 path is the same: a gateway of the previous release replays it there.
SANDBOX_ROUTES: dict[SandboxOp, tuple[str, str]] = {
    SandboxOp.INFO: ("GET", "/sandboxes/{id}"),
    SandboxOp.KILL: ("DELETE", "/sandboxes/{id}"),
    SandboxOp.PAUSE: ("POST", "/sandboxes/{id}/pause"),
    SandboxOp.RESUME: ("POST", "/sandboxes/{id}/resume"),
    SandboxOp.CONNECT: ("POST", "/sandboxes/{id}/connect"),
    SandboxOp.TIMEOUT: ("POST", "/sandboxes/{id}/timeout"),
    SandboxOp.REFRESH: ("POST", "/sandboxes/{id}/refreshes"),
    SandboxOp.SNAPSHOT: ("POST", "/sandboxes/{id}/snapshots"),
    SandboxOp.FORK: ("POST", "/sandboxes/{id}/fork"),
    SandboxOp.NETWORK: ("PUT", "/sandboxes/{id}/network"),
    SandboxOp.LOGS: ("GET", "/sandboxes/{id}/logs"),
    SandboxOp.LOGS_V2: ("GET", "/v2/sandboxes/{id}/logs"),
    SandboxOp.METRICS: ("GET", "/sandboxes/{id}/metrics"),
    SandboxOp.EVENTS: ("GET", "/events/sandboxes/{id}"),
    SandboxOp.RELEASE: ("POST", "/cluster/sandboxes/{id}/release"),
    SandboxOp.RESET: ("POST", RESET.format(sandbox_id="{id}")),
    SandboxOp.BATCH_FORK: ("POST", BATCH_FORK.format(sandbox_id="{id}")),
}
TEMPLATE_ROUTES: dict[TemplateOp, tuple[str, str]] = {
    TemplateOp.INFO: ("GET", "/templates/{id}"),
    TemplateOp.ALIAS: ("GET", "/templates/aliases/{id}"),
    TemplateOp.UPDATE: ("PATCH", "/templates/{id}"),
    TemplateOp.DELETE: ("DELETE", "/templates/{id}"),
    TemplateOp.TAGS: ("GET", "/templates/{id}/tags"),
}
BUILD_ROUTES: dict[BuildOp, tuple[str, str]] = {
    BuildOp.START: ("POST", "/v2/templates/{id}/builds/{build}"),
    BuildOp.STATUS: ("GET", "/templates/{id}/builds/{build}/status"),
    BuildOp.LOGS: ("GET", "/templates/{id}/builds/{build}/logs"),
}
BUILDS_ROUTE = "/v3/templates"  # `POST`: a build request
FILES_ROUTE = "/templates/{id}/files/{hash}"  # `GET`; its `PUT` (the upload) streams: replayed
VOLUME_ROUTES: dict[VolumeOp, tuple[str, str]] = {
    VolumeOp.INFO: ("GET", "/volumes/{id}"),
    VolumeOp.DELETE: ("DELETE", "/volumes/{id}"),
}
TAG_ROUTES: dict[TagOp, tuple[str, str]] = {
    TagOp.ASSIGN: ("POST", "/templates/tags"),
    TagOp.DELETE: ("DELETE", "/templates/tags"),
}
LIST_ROUTES: dict[ListOp, tuple[str, str]] = {
    ListOp.SANDBOXES: ("GET", "/sandboxes"),
    ListOp.SANDBOXES_V2: ("GET", "/v2/sandboxes"),
    ListOp.SNAPSHOTS: ("GET", "/snapshots"),
    ListOp.TEMPLATES: ("GET", "/templates"),
    ListOp.TEMPLATES_V2: ("GET", "/v2/templates"),
    ListOp.VOLUMES: ("GET", "/volumes"),
    ListOp.EVENTS: ("GET", "/events/sandboxes"),
}
BULK_ROUTES: dict[BulkOp, tuple[str, str]] = {
    op: ("POST", f"{BULK_SANDBOXES}/{op.value}") for op in BulkOp
}
DELIVERIES_ROUTE = "/events/webhooks/{id}/deliveries"
METRICS_ROUTE = "/sandboxes/metrics"  # `GET`, the ids in `sandbox_ids`, comma-separated
CREATE_ROUTES = {E2BApi.V1: "/sandboxes", E2BApi.V2: "/v2/sandboxes"}
VOLUMES_ROUTE = "/volumes"
ADOPT_ROUTES = {AdoptKind.SANDBOX: "/cluster/adopt", AdoptKind.TEMPLATE: "/cluster/templates"}

E = TypeVar("E", bound=StrEnum)


@dataclass(frozen=True)
class Family(Generic[E]):
    """The version 1 calls on one kind of thing: `POST PREFIX_V1 + path`, whose `{op}` (one of
    `ops`) picks the E2B route (method, path) a node runs the call through, and whose other
    parts are that route's own; the body is a `call`."""

    path: str
    ops: type[E]
    routes: Mapping[E, tuple[str, str]]
    call: type[E2BCall]
    # More E2B routes of an operation (E2B's `/v2` aliases), which a gateway sends as it.
    aliases: tuple[tuple[E, tuple[str, str]], ...] = ()


@dataclass(frozen=True)
class Single:
    """A version 1 call of its own: `POST PREFIX_V1 + path` (its parts the E2B route's), run
    through the E2B `route` (method, path)."""

    path: str
    route: tuple[str, str]
    call: type[E2BCall]


# In the order a gateway matches E2B requests to them: `/templates/tags` is no template's id.
FAMILIES: tuple[Family[Any], ...] = (
    Family("/tags/{op}", TagOp, TAG_ROUTES, TagCall),
    Family(
        "/templates/{id}/{op}",
        TemplateOp,
        TEMPLATE_ROUTES,
        TemplateCall,
        aliases=((TemplateOp.UPDATE, ("PATCH", "/v2/templates/{id}")),),
    ),
    Family("/templates/{id}/builds/{build}/{op}", BuildOp, BUILD_ROUTES, BuildCall),
    Family(
        "/sandboxes/{id}/{op}",
        SandboxOp,
        SANDBOX_ROUTES,
        SandboxCall,
        aliases=((SandboxOp.CONNECT, ("POST", "/v2/sandboxes/{id}/connect")),),
    ),
    Family("/volumes/{id}/{op}", VolumeOp, VOLUME_ROUTES, VolumeCall),
    Family("/lists/{op}", ListOp, LIST_ROUTES, ListCall),
    Family("/bulk/{op}", BulkOp, BULK_ROUTES, BulkCall),
)
SINGLES = (
    Single("/volumes", ("POST", VOLUMES_ROUTE), CreateVolume),
    Single("/builds", ("POST", BUILDS_ROUTE), RequestBuild),
    Single("/templates/{id}/files/{hash}", ("GET", FILES_ROUTE), FilesCall),
    Single("/webhooks/{id}/deliveries", ("GET", DELIVERIES_ROUTE), DeliveriesCall),
)
