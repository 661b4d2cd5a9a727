"""`GET /openapi.json`: the OpenAPI document of exactly what this node's control plane serves.

Built once at startup from E2B's own API spec (package data `specs/e2b.yml`, a verbatim copy of
the repository's `specs/e2b/openapi.yml`) and the app's route table, so a route added to the app
appears without editing this module:

- every (path, method) the app routes is looked up in the E2B spec (path parameters match by
  position, not name: our `{sandbox_id}` is E2B's `{sandboxID}`) and kept with the components
  it references, transitively; the rest of the spec is dropped;
- routes the spec lacks get a hand-written operation (`_OWN`), one derived from the E2B
  operation they mirror (`_SAME_AS`: the SDKs' v2 routes, which the spec does not list yet), or
  at least a stub naming them;
- security is what the node checks: the API key in `X-API-Key` (E2B's `ApiKeyAuth`), none on
  the open paths, the operator's token on the admin routes (`AdminApiKeyAuth`);
- responses the spec leaves out but the node gives for any such operation are added (400 for
  input it rejects, 401 without a key, 404 for unknown ids, 413 for an oversized body, 429 when
  full), so the document describes what clients actually get.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Collection, Iterator, Sequence
from importlib import resources
from typing import Any

import yaml
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from aenv import __version__
from aenv.api.extensions import ADMIN_PREFIXES
from aenv.config import MAX_VOLUME_MB, MIN_VOLUME_MB

PATH = "/openapi.json"
Operation = dict[str, Any]

_PARAM = re.compile(r"\{[^}]*\}")
_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
# Not among the spec's shared responses; the node's own error shape, like every other error.
_TOO_LARGE = {"description": "The request body is too large", "content": _ERROR}
_KEY_REUSED = {
    "description": "The Idempotency-Key was used for a different create request",
    "content": _ERROR,
}
_NO_DISK = {"description": "The node's disk above its reserve cannot hold it", "content": _ERROR}
_OWN_RESPONSES = {"413": _TOO_LARGE, "422": _KEY_REUSED, "507": _NO_DISK}
# Fields this node adds to E2B's schemas.
_SIZE_MB = {
    "type": "integer",
    "nullable": True,
    "minimum": MIN_VOLUME_MB,
    "maximum": MAX_VOLUME_MB,
    "description": "The volume's size in MiB (this node's field): writes past it fail with "
    "ENOSPC. Absent at a create: the node's `volume_size_mb`. Null: a volume made before sizes, "
    "unbounded.",
}
_OWN_FIELDS: dict[str, dict[str, Any]] = {
    "NewVolume": {"sizeMB": _SIZE_MB},
    "VolumeAndToken": {"sizeMB": _SIZE_MB},
}

# Routes the E2B spec lacks, described here.
_OWN: dict[tuple[str, str], Operation] = {
    ("/metrics", "get"): {
        "summary": "Prometheus metrics",
        "description": "Sandboxes by state, the create queue and outcomes, create latency, warm "
        "network slots, in the Prometheus text format.",
        "tags": ["node"],
        "responses": {
            "200": {
                "description": "The node's current metrics",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    },
    (PATH, "get"): {
        "summary": "This document",
        "description": "The OpenAPI document of every route this node serves.",
        "tags": ["node"],
        "responses": {
            "200": {
                "description": "The OpenAPI document",
                "content": {"application/json": {"schema": {"type": "object"}}},
            }
        },
    },
    ("/aenv/queue", "get"): {
        "summary": "Creates waiting for capacity (this node's extension)",
        "description": "A create or fork sent with the `X-Aenv-Wait: <seconds>` header waits "
        "for capacity, up to that (cut to the node's `create_max_wait`), instead of answering "
        "429 at once; waiters are served round robin across teams, FIFO within one. This "
        "answers how many wait on the node and where the caller's team's stand (1 is next).",
        "tags": ["sandboxes"],
        "responses": {
            "200": {
                "description": "The queue",
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["waiting", "positions", "maxWait"],
                            "properties": {
                                "waiting": {"type": "integer"},
                                "positions": {"type": "array", "items": {"type": "integer"}},
                                "maxWait": {"type": "number"},
                            },
                        }
                    }
                },
            }
        },
    },
    ("/aenv/sandboxes/{sandboxID}/reset", "post"): {
        "summary": "Reset a sandbox in place (this node's extension)",
        "description": "Return a running sandbox to the state of a snapshot or template: a "
        "new VM restored from it replaces the sandbox's, which keeps its id, envd and traffic "
        "tokens, network rules, metadata and timeout. A failed reset leaves the sandbox "
        "running as it was.",
        "tags": ["sandboxes"],
        "parameters": [{"$ref": "#/components/parameters/sandboxID"}],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "required": ["snapshotID"],
                        "properties": {
                            "snapshotID": {
                                "type": "string",
                                "description": "A snapshot or template (id or name)",
                            },
                            "timeout": {
                                "type": "integer",
                                "minimum": 1,
                                "description": "Seconds the sandbox then runs; absent, its "
                                "end stays",
                            },
                        },
                    }
                }
            },
        },
        "responses": {
            "200": {
                "description": "The sandbox, reset",
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/Sandbox"}}
                },
            },
            "409": {"description": "The sandbox is not running", "content": _ERROR},
            "500": {
                "description": "The reset failed; the sandbox runs as it was",
                "content": _ERROR,
            },
        },
    },
}
# Routes the SDKs call that the spec does not list yet, each the same as an E2B operation
# (path, method) but for what the note says.
_SAME_AS: dict[tuple[str, str], tuple[str, str, str]] = {
    ("/v2/sandboxes", "post"): ("/sandboxes", "post", "v2: the timeout defaults to 300 seconds"),
    ("/v2/sandboxes/{sandboxID}/connect", "post"): ("/sandboxes/{sandboxID}/connect", "post", "v2"),
}
# Responses an operation gives beyond the generic ones, which the spec omits.
_EXTRA_RESPONSES: dict[tuple[str, str], tuple[str, ...]] = {
    # Unknown template, Idempotency-Key reused, node full.
    ("/sandboxes", "post"): ("404", "422", "429"),
    ("/v2/sandboxes", "post"): ("404", "422", "429"),
    ("/volumes", "post"): ("507",),
}


def _shape(path: str) -> str:
    return _PARAM.sub("{}", path)


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def _components(spec: dict[str, Any], roots: Any) -> dict[str, dict[str, Any]]:
    """The components `roots` reference, directly or through other components."""
    kept: dict[str, dict[str, Any]] = {}
    pending = list(_refs(roots))
    while pending:
        ref = pending.pop()
        _, _, kind, name = ref.split("/", 3)  # "#/components/<kind>/<name>"
        if name in kept.get(kind, {}):
            continue
        component = spec["components"][kind][name]
        kept.setdefault(kind, {})[name] = component
        pending.extend(_refs(component))
    return {kind: dict(sorted(named.items())) for kind, named in sorted(kept.items())}


def _stub(route: Route, path: str, method: str) -> Operation:
    """A route neither the spec nor this module describes still appears, with the parameters of
    `path` (the spec's spelling when the spec has other methods on it)."""
    doc = (route.endpoint.__doc__ or "").strip()
    return {
        "summary": doc.splitlines()[0] if doc else f"{method.upper()} {path}",
        "parameters": [
            {"name": name[1:-1], "in": "path", "required": True, "schema": {"type": "string"}}
            for name in _PARAM.findall(path)
        ],
        "responses": {"default": {"description": "Not described in the E2B API"}},
    }


def _add_responses(op: Operation, path: str, method: str, secured: bool) -> None:
    wanted = list(_EXTRA_RESPONSES.get((path, method), ()))
    if secured:
        wanted.append("401")
    wanted.append("400")  # every route refuses a query parameter it does not honour
    if "requestBody" in op:
        wanted.append("413")
    if _PARAM.search(path):
        wanted.append("404")
    responses = op.setdefault("responses", {})
    for status in wanted:
        if status not in responses:
            responses[status] = _OWN_RESPONSES.get(
                status, {"$ref": f"#/components/responses/{status}"}
            )


def build_document(
    spec: dict[str, Any], routes: Sequence[BaseRoute], open_paths: Collection[str]
) -> dict[str, Any]:
    named = [*spec["paths"], *(path for path, _ in _OWN), *(path for path, _ in _SAME_AS)]
    by_shape = {_shape(path): path for path in named}
    paths: dict[str, dict[str, Operation]] = {}
    for route in routes:
        if not isinstance(route, Route) or not route.include_in_schema:
            continue
        for method in sorted((route.methods or set()) - {"HEAD"}):
            method = method.lower()
            path = by_shape.get(_shape(route.path), route.path)
            if (path, method) in _OWN:
                op = copy.deepcopy(_OWN[path, method])
            elif method in spec["paths"].get(path, {}):
                op = copy.deepcopy(spec["paths"][path][method])
            elif (path, method) in _SAME_AS:
                source, source_method, note = _SAME_AS[path, method]
                op = copy.deepcopy(spec["paths"][source][source_method])
                op["description"] = f"{op.get('description', '')} ({note})".strip()
            else:
                op = _stub(route, path, method)
            secured = route.path not in open_paths
            if route.path.startswith(ADMIN_PREFIXES):
                op["security"] = [{"AdminApiKeyAuth": []}]
            else:
                op["security"] = [{"ApiKeyAuth": []}] if secured else []
            _add_responses(op, path, method, secured)
            paths.setdefault(path, {})[method] = op
    paths = dict(sorted(paths.items()))
    components = _components(spec, paths)
    for name, fields in _OWN_FIELDS.items():
        if name in components.get("schemas", {}):
            schema = components["schemas"][name] = copy.deepcopy(components["schemas"][name])
            schema["properties"].update(fields)
    schemes = spec["components"]["securitySchemes"]
    used = {
        name for ops in paths.values() for op in ops.values() for s in op["security"] for name in s
    }
    components["securitySchemes"] = {
        name: schemes[name] for name in ("ApiKeyAuth", "AdminApiKeyAuth") if name in used
    }
    used_tags = {tag for ops in paths.values() for op in ops.values() for tag in op.get("tags", [])}
    return {
        "openapi": spec["openapi"],
        "info": {
            "title": "AENV-py node API",
            "version": __version__,
            "description": "The E2B control-plane API as this node serves it: the operations of "
            f"E2B's spec (version {spec['info']['version']}) it implements, and its own.",
        },
        "tags": [{"name": tag} for tag in sorted(used_tags)],
        "paths": paths,
        "components": components,
    }


@functools.cache
def load_e2b_spec() -> dict[str, Any]:
    """E2B's spec, parsed once per process: every app built (a node's, a gateway's, each test's)
    reads the same shipped file, a third of a second of CPU to parse. Shared, so read-only:
    `build_document` copies what it changes."""
    text = resources.files("aenv.api").joinpath("specs/e2b.yml").read_text()
    # The C loader: the pure-Python one takes about a second on this 130 kB file.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    spec: dict[str, Any] = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    return spec


class OpenAPIDocument:
    """The document of `routes` plus its own route, built once at its first request (40 ms
    of CPU that an app which is never asked for it, as most tests' are, does without); `route`
    serves it."""

    def __init__(self, routes: Sequence[BaseRoute], open_paths: Collection[str]) -> None:
        self.route = Route(PATH, self.endpoint, methods=["GET"])
        self._routes = [*routes, self.route]
        self._open_paths = open_paths

    @functools.cached_property
    def body(self) -> bytes:
        document = build_document(load_e2b_spec(), self._routes, self._open_paths)
        return json.dumps(document, separators=(",", ":")).encode()

    async def endpoint(self, _: Request) -> Response:
        return Response(self.body, media_type="application/json")
