"""route(): which scopes are data-plane traffic, for which sandbox and port, and what the
sandbox sees as its path."""

from __future__ import annotations

from typing import Any

import pytest

from aenv.proxy import RoutingError, Target, route

SID = "abcdefghij0123456789"


def scope(
    path: str = "/", headers: dict[str, str] | None = None, raw_path: bytes | None = None
) -> dict[str, Any]:
    return {
        "type": "http",
        "path": path,
        "raw_path": raw_path if raw_path is not None else path.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }


def test_headers_route_whatever_the_path_and_host() -> None:
    headers = {
        "Host": "8000-other.aenv.test",
        "E2b-Sandbox-Id": SID,
        "E2b-Sandbox-Port": "49983",
    }
    for path in ("/health", "/metrics", "/sandboxes", f"/proxy/{SID}/1/x"):
        assert route(scope(path, headers), "aenv.test") == Target(SID, 49983, path, path.encode())


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"E2b-Sandbox-Id": SID}, "Missing header: E2b-Sandbox-Port"),
        ({"E2b-Sandbox-Port": "49983"}, "Missing header: E2b-Sandbox-Id"),
        ({"E2b-Sandbox-Id": "", "E2b-Sandbox-Port": "49983"}, "Missing header: E2b-Sandbox-Id"),
        ({"E2b-Sandbox-Id": SID, "E2b-Sandbox-Port": "http"}, "Invalid sandbox port"),
        ({"E2b-Sandbox-Id": SID, "E2b-Sandbox-Port": "65536"}, "Invalid sandbox port"),
        ({"E2b-Sandbox-Id": SID, "E2b-Sandbox-Port": "0"}, "Invalid sandbox port"),
        ({"E2b-Sandbox-Id": "Bad-Id", "E2b-Sandbox-Port": "1"}, "Invalid sandbox ID"),
    ],
)
def test_bad_routing_headers(headers: dict[str, str], message: str) -> None:
    with pytest.raises(RoutingError) as caught:
        route(scope("/health", headers), None)
    assert caught.value.message == message


@pytest.mark.parametrize(
    "host",
    [f"8080-{SID}.aenv.test", f"8080-{SID}.aenv.test:3000", f"8080-{SID}.AENV.test."],
)
def test_host_routing(host: str) -> None:
    assert route(scope("/a/b", {"Host": host}), "aenv.test") == Target(SID, 8080, "/a/b", b"/a/b")


def test_host_routing_with_a_port_in_the_domain() -> None:
    host = f"8080-{SID}.aenv.test:8443"
    assert route(scope("/", {"Host": host}), "aenv.test:8443") == Target(SID, 8080, "/", b"/")


@pytest.mark.parametrize("domain", [None, "aenv.test"])
def test_localhost_names_are_routed_with_or_without_a_domain(domain: str | None) -> None:
    host = f"8080-{SID}.localhost:3000"
    assert route(scope("/", {"Host": host}), domain) == Target(SID, 8080, "/", b"/")


def test_header_values_are_trimmed() -> None:
    headers = {"E2b-Sandbox-Id": f" {SID} ", "E2b-Sandbox-Port": " 49983"}
    assert route(scope("/", headers), None) == Target(SID, 49983, "/", b"/")


@pytest.mark.parametrize(
    ("host", "domain"),
    [
        ("api.aenv.test", "aenv.test"),  # the control plane on the same domain
        ("aenv.test", "aenv.test"),
        (f"8080-{SID}.elsewhere.test", "aenv.test"),
        (f"8080-{SID}.aenv.test", None),  # no domain: only `*.localhost`
        ("api.localhost:3000", None),
        ("localhost:3000", "aenv.test"),
        ("my-app.aenv.test", "aenv.test"),  # no `{port}-` label
    ],
)
def test_hosts_that_are_control_plane(host: str, domain: str | None) -> None:
    assert route(scope("/health", {"Host": host}), domain) is None


def test_host_with_a_dash_in_the_id_is_refused() -> None:
    with pytest.raises(RoutingError, match="Invalid sandbox ID"):
        route(scope("/", {"Host": "8080-abc-def.aenv.test"}), "aenv.test")


def test_path_routing_strips_the_prefix_and_keeps_escapes() -> None:
    raw = f"/proxy/{SID}/8000/a%2Fb/c%20d".encode()
    target = route(scope(f"/proxy/{SID}/8000/a/b/c d", raw_path=raw), None)
    assert target == Target(SID, 8000, "/a/b/c d", b"/a%2Fb/c%20d")


@pytest.mark.parametrize(
    ("path", "rest"), [(f"/proxy/{SID}/8000", "/"), (f"/proxy/{SID}/8000/", "/")]
)
def test_path_routing_to_the_root(path: str, rest: str) -> None:
    assert route(scope(path), None) == Target(SID, 8000, rest, rest.encode())


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (f"/proxy/{SID}", "Expected /proxy/{sandboxId}/{port}/..."),
        (f"/proxy/{SID}/port/x", "Invalid sandbox port"),
        ("/proxy/UPPER/1/x", "Invalid sandbox ID"),
    ],
)
def test_bad_proxy_paths(path: str, message: str) -> None:
    with pytest.raises(RoutingError) as caught:
        route(scope(path), None)
    assert caught.value.message == message


def test_everything_else_is_control_plane() -> None:
    for path in ("/health", "/sandboxes", "/v2/sandboxes", "/proxy", "/proxyx/a/1"):
        assert route(scope(path, {"Host": "localhost:3000"}), "aenv.test") is None
