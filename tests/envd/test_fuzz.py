"""Property-based fuzzing of a real envd process: every Connect method and HTTP route gets
hostile requests (malformed protobuf and JSON, wrong types and content types, odd and huge
paths, unicode, out-of-range numbers, broken framing and headers).

The property, for every request: an answer arrives within the client's timeout, it is a
well-formed Connect error or HTTP JSON error (never INTERNAL/UNKNOWN, never a 5xx with a
traceback), and envd still answers /health. At the end envd still runs commands.
"""

from __future__ import annotations

import gzip
import json
import struct
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.envd.fuzz_inputs import (
    FUZZ_DIR,
    Method,
    bodies,
    methods,
    mutable_paths,
    readable_paths,
    rpc_headers,
    wrong_json,
)
from tests.envd.helpers import assert_envd_serves, sandbox_for
from tests.support.envd_process import python_paths, serve_in_throwaway_root
from tests.support.ports import free_port

# Enough examples to reach every branch the strategies can, few enough that the whole file runs
# in about a minute on the shared 2-core machine.
FUZZ = settings(
    max_examples=60,
    deadline=None,
    database=None,
    # No shrinking: a failure's message already holds the whole request, and shrinking against
    # a hang would take minutes.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# Long enough that only a hang trips it.
TIMEOUT = httpx.Timeout(20.0, pool=5.0)
# Frames of a streaming answer read before the client leaves (a watch streams forever).
MAX_FRAMES = 20

_CONNECT_CODES = {
    "canceled",
    "unknown",
    "invalid_argument",
    "deadline_exceeded",
    "not_found",
    "already_exists",
    "permission_denied",
    "resource_exhausted",
    "failed_precondition",
    "aborted",
    "out_of_range",
    "unimplemented",
    "internal",
    "unavailable",
    "data_loss",
    "unauthenticated",
}
# A bug in envd, never the request's fault.
_SERVER_FAULTS = {"internal", "unknown", "data_loss"}


@pytest.fixture(scope="module")
def envd() -> Iterator[str]:
    """envd as root of a throwaway root that fuzzed requests cannot harm the host through:
    random protobuf bytes decode to any path or command (a Remove of "/" once emptied the
    shared Python's lib directory through the read-write bind of the project's interpreter),
    so the project and its Python are bound read-only and /dev is the root's own."""
    port = free_port()
    read_only = [option for p in python_paths() for option in ("--ro-bind", p, p)]
    envd = [sys.executable, "-m", "aenv.envd", "--host", "127.0.0.1", "--port", str(port)]
    with serve_in_throwaway_root(envd, port, harness_options=["--private-dev", *read_only]) as url:
        yield url


@pytest.fixture(scope="module")
def client(envd: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=envd, timeout=TIMEOUT) as c:
        for host_path in python_paths():
            refused = c.post("/filesystem.Filesystem/MakeDir", json={"path": f"{host_path}/x"})
            assert refused.json()["code"] == "permission_denied", f"{host_path} is writable"
        host_device = c.post("/filesystem.Filesystem/Stat", json={"path": "/dev/loop-control"})
        assert host_device.status_code == 404, "the host's /dev is in the fuzzed root"
        c.post("/filesystem.Filesystem/MakeDir", json={"path": FUZZ_DIR})
        yield c
        # Undo what fuzzed /init calls left (a missing default user or workdir).
        c.post("/init", json={"defaultUser": "user", "defaultWorkdir": "", "envVars": {}})
    assert_envd_serves(sandbox_for(envd), envd)


def _healthy(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 204


def _connect_error(error: Any, context: str) -> None:
    assert isinstance(error, dict), context
    assert error.get("code") in _CONNECT_CODES, context
    message = error.get("message", "")
    assert isinstance(message, str), context
    # connect-go's own code for a compressed envelope with no encoding (test_bad_input pins it).
    if message.startswith("protocol error: sent compressed message without compression"):
        return
    assert error["code"] not in _SERVER_FAULTS, context


def _check_unary(response: httpx.Response, context: str) -> None:
    if response.status_code == 200:
        return
    if response.status_code in (404, 405, 415) and not response.content:
        # The Connect protocol's answers to no such method, a GET of a method that takes only
        # POST and a content type the method does not speak: a status without a body.
        return
    assert response.status_code < 500 or response.status_code in (501, 503, 504), context
    assert response.headers.get("content-type", "").startswith("application/json"), context
    _connect_error(response.json(), context)


def _frames(response: httpx.Response) -> Iterator[tuple[int, bytes]]:
    """The envelopes of a streaming answer as they arrive; a truncated one fails."""
    buffer = b""
    for chunk in response.iter_bytes():
        buffer += chunk
        while len(buffer) >= 5:
            flags, length = struct.unpack_from(">BI", buffer)
            if len(buffer) < 5 + length:
                break
            yield flags, buffer[5 : 5 + length]
            buffer = buffer[5 + length :]
    assert buffer == b"", f"truncated envelope at the end of the stream: {buffer!r}"


def _check_stream(response: httpx.Response, context: str) -> None:
    if not response.headers.get("content-type", "").startswith("application/connect+"):
        response.read()
        _check_unary(response, context)
        return
    assert response.status_code == 200, context
    for count, (flags, payload) in enumerate(_frames(response)):
        if flags & 2:
            end = json.loads(gzip.decompress(payload) if flags & 1 else payload)
            if "error" in end:
                _connect_error(end["error"], f"{context}: {end}")
            return
        assert flags == 0, context
        if count >= MAX_FRAMES or response.request.url.path.endswith("WatchDir"):
            return  # still streaming, well framed so far: leaving is the client's right
    raise AssertionError(f"stream ended without an end-of-stream frame: {context}")


@pytest.mark.parametrize("method", methods(), ids=lambda m: m.path.rsplit("/", 1)[-1])
def test_connect_method(client: httpx.Client, method: Method) -> None:
    @FUZZ
    @given(body=bodies(method), headers=rpc_headers())
    def fuzz(body: tuple[str, bytes], headers: dict[str, str]) -> None:
        content_type, content = body
        headers = {**headers, "Content-Type": content_type} if content_type else headers
        context = f"{method.path} {headers} {content[:300]!r}"
        try:
            request = client.build_request("POST", method.path, content=content, headers=headers)
            response = client.send(request, stream=True)
        except httpx.LocalProtocolError:
            return  # httpx refused to send a header value: nothing reached envd
        try:
            if method.streams:
                _check_stream(response, context)
            else:
                response.read()
                _check_unary(response, context)
        finally:
            response.close()
        _healthy(client)

    fuzz()


def _check_http(response: httpx.Response, context: str) -> None:
    if response.status_code < 400:
        return
    path = response.request.url.path
    if path.startswith(("/process.Process/", "/filesystem.Filesystem/")):
        _check_unary(response, context)
        return
    if response.request.method == "HEAD":
        assert response.content == b"", context
        return
    context = f"{response.status_code} {response.headers} {response.text[:300]!r}: {context}"
    assert response.status_code < 500, context
    assert response.headers.get("content-type") == "application/json", context
    body = response.json()
    assert isinstance(body, dict), context
    assert isinstance(body.get("code"), int), context
    assert isinstance(body.get("message"), str), context


_users = st.one_of(st.sampled_from(["user", "root", "nobody", ""]), st.text(max_size=20))
_query_extra = st.dictionaries(
    st.sampled_from(["signature", "signature_expiration", "path", "username", "x"]),
    st.text(max_size=30),
    max_size=2,
)


@FUZZ
@given(
    path=readable_paths,
    username=_users,
    extra=_query_extra,
    accept=st.sampled_from(["", "gzip", "identity;q=0", "br", "*;q=0", "gzip;q=x"]),
    range_=st.sampled_from([None, "bytes=0-1", "bytes=-5", "bytes=9-2", "lines=1", "bytes=x"]),
)
def test_download(
    client: httpx.Client,
    path: str,
    username: str,
    extra: dict[str, str],
    accept: str,
    range_: str | None,
) -> None:
    headers = {"Accept-Encoding": accept} | ({"Range": range_} if range_ is not None else {})
    params = {"path": path, "username": username, **extra}
    with client.stream("GET", "/files", params=params, headers=headers) as response:
        context = f"GET /files {params} {headers}"
        if response.status_code < 400:
            next(response.iter_raw(), None)  # a device may stream forever: a chunk is enough
        else:
            response.read()
            if range_ is not None and response.headers["content-type"].startswith("text/plain"):
                # Starlette's FileResponse answers a bad Range itself (400 or 416, plain text
                # as Go's http.ServeContent does): a known departure from JSON errors.
                assert response.status_code in (400, 416), context
            else:
                _check_http(response, context)
    _healthy(client)


def _multipart(boundary: str, parts: list[tuple[str, bytes]]) -> bytes:
    out = b""
    for filename, data in parts:
        out += f"--{boundary}\r\n".encode()
        disposition = f'form-data; name="file"; filename="{filename}"'
        out += f"Content-Disposition: {disposition}\r\n\r\n".encode("utf-8", "surrogatepass")
        out += data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


@st.composite
def _upload_bodies(draw: st.DrawFn) -> tuple[dict[str, str], bytes]:
    kind = draw(st.sampled_from(["octet", "multipart", "junk"]))
    data = draw(st.binary(max_size=300))
    if kind == "octet":
        return {"Content-Type": "application/octet-stream"}, data
    if kind == "multipart":
        boundary = draw(st.sampled_from(["b0undary", "x", "a" * 100]))
        files = st.tuples(mutable_paths, st.binary(max_size=100))
        body = _multipart(boundary, draw(st.lists(files, max_size=3)))
        body = draw(st.sampled_from([body, body[: len(body) // 2], body.replace(b"\r\n", b"\n")]))
        header = draw(
            st.sampled_from(
                [
                    f"multipart/form-data; boundary={boundary}",
                    "multipart/form-data",
                    "multipart/form-data; boundary=",
                ]
            )
        )
        return {"Content-Type": header}, body
    content_type = draw(
        st.sampled_from(["", "text/plain", "application/json", "application/x-aenv-unknown"])
    )
    return ({"Content-Type": content_type} if content_type else {}), data


@FUZZ
@given(
    path=st.one_of(st.none(), mutable_paths),
    username=_users,
    upload=_upload_bodies(),
    encoding=st.sampled_from([None, "gzip", "identity", "br", ""]),
    metadata=st.dictionaries(
        st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=20),
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=50),
        max_size=3,
    ),
)
def test_upload(
    client: httpx.Client,
    path: str | None,
    username: str,
    upload: tuple[dict[str, str], bytes],
    encoding: str | None,
    metadata: dict[str, str],
) -> None:
    headers, content = upload
    if encoding is not None:
        headers = {**headers, "Content-Encoding": encoding}
    headers |= {f"X-Metadata-{k}": v for k, v in metadata.items()}
    params = {"username": username} | ({"path": path} if path is not None else {})
    try:
        response = client.post("/files", params=params, headers=headers, content=content)
    except httpx.LocalProtocolError:
        return  # httpx refused to send a header value; nothing reached envd
    _check_http(response, f"POST /files {params} {headers} {content[:200]!r}")
    _healthy(client)


# /init fields that change nothing outside envd: the clock, the hostname and the RNG it would
# set are the host's here (the throwaway root shares them), and a token would lock us out.
_init_bodies = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "envVars": st.one_of(st.dictionaries(st.text(), st.text(), max_size=3), wrong_json),
            "defaultUser": st.one_of(_users, wrong_json),
            "defaultWorkdir": st.one_of(readable_paths, wrong_json),
            "entropy": st.sampled_from(["!", "not base64", "=="]),
            "timestamp": st.sampled_from(["soon", [], {}]),
            "hostname": st.sampled_from([[], {}, 5]),
            "extra": wrong_json,
        },
    ).map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=100),
    st.sampled_from([b"", b"null", b"[]", b"{", b'{"envVars": {"a": 1}}']),
)


@FUZZ
@given(body=_init_bodies, content_type=st.sampled_from(["application/json", "text/plain", ""]))
def test_init(client: httpx.Client, body: bytes, content_type: str) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    response = client.post("/init", content=body, headers=headers)
    _check_http(response, f"POST /init {body!r}")
    _healthy(client)


_copy_bodies = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "archive": st.one_of(mutable_paths, wrong_json),
            "src": st.one_of(st.sampled_from([".", "*", "a/../../x", "/"]), st.text(max_size=20)),
            "dest": st.one_of(mutable_paths, wrong_json),
            "owner": st.one_of(_users, wrong_json),
            "mode": st.one_of(st.sampled_from(["755", "0644", "9999", "-1", ""]), wrong_json),
        },
    ).map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=100),
)


@FUZZ
@given(body=_copy_bodies)
def test_copy(client: httpx.Client, body: bytes) -> None:
    response = client.post("/aenv/copy", content=body)
    _check_http(response, f"POST /aenv/copy {body!r}")
    _healthy(client)


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
    path=st.one_of(
        st.sampled_from(
            [
                "/health",
                "/envs",
                "/metrics",
                "/init",
                "/files",
                "/aenv/copy",
                "/process.Process/",
                "/process.Process/Nope",
                "/filesystem.Filesystem",
                "/",
                "//health",
                "/health/",
                "/%2e%2e/health",
            ]
        ),
        st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30).map(
            lambda p: "/" + p
        ),
    ),
)
def test_any_route(client: httpx.Client, method: str, path: str) -> None:
    """Every method on every route, known or not: unknown ones are JSON errors too."""
    if (method, path) == ("POST", "/sync"):
        return  # syncs the host's disks here (no route bug to find for a body-less POST)
    try:
        request = client.build_request(method, path)
    except httpx.InvalidURL:
        return
    response = client.send(request)
    _check_http(response, f"{method} {path}")
    _healthy(client)


# What the fuzzer found, pinned as plain examples.


@pytest.mark.parametrize("content_type", ["application/grpc", "application/grpc+proto"])
def test_grpc_without_trailers_is_refused(client: httpx.Client, content_type: str) -> None:
    """gRPC needs trailers, which uvicorn cannot send: a 415 JSON error, not a bare 500."""
    response = client.post(
        "/filesystem.Filesystem/Stat", content=b"\0\0\0\0\0", headers={"Content-Type": content_type}
    )
    assert response.status_code == 415
    assert response.json()["code"] == "unimplemented"


def test_user_name_with_nul_byte(client: httpx.Client) -> None:
    """A NUL byte in a user name is an unknown user (pwd raises ValueError for it)."""
    auth = {"Authorization": "Basic AA=="}  # base64 of a single NUL byte
    rpc = client.post("/process.Process/List", json={}, headers=auth)
    assert (rpc.status_code, rpc.json()["code"]) == (401, "unauthenticated")
    files = client.get("/files", params={"path": "/etc/hostname", "username": "\0"})
    assert (files.status_code, files.json()["code"]) == (401, 401)


@pytest.mark.parametrize(
    ("method", "path", "status"), [("GET", "/nope", 404), ("PUT", "/files", 405)]
)
def test_unknown_route_is_a_json_error(
    client: httpx.Client, method: str, path: str, status: int
) -> None:
    response = client.request(method, path)
    assert response.status_code == status
    assert response.json()["code"] == status


def test_upload_name_too_long(client: httpx.Client) -> None:
    # Under /tmp: the fuzzed requests may have left anything at FUZZ_DIR, a file even.
    path = f"/tmp/{'a' * 300}"
    response = client.post(
        "/files",
        params={"path": path, "username": "root"},
        headers={"Content-Type": "application/octet-stream"},
    )
    assert response.status_code == 400
    assert "too long" in response.json()["message"]
