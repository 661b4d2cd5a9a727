"""Bad input gets the Connect/HTTP error the SDK maps correctly, and envd keeps serving: raw
protocol abuse (httpx), bad paths, unknown users, bad process requests, oversize and malformed
uploads, unsupported encodings."""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Iterator

import httpx
import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    InvalidArgumentException,
    NotFoundException,
    Sandbox,
    SandboxException,
)

from tests.envd.helpers import (
    STREAM_HEADERS,
    UNARY_HEADERS,
    assert_envd_serves,
    envelope,
    extra_envd,
    parse_envelopes,
    sandbox_for,
)


def _end_stream_error(response: httpx.Response) -> dict[str, str]:
    """The error of a streaming response that failed before any message."""
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/connect+json"
    frames = parse_envelopes(response.content)
    assert len(frames) == 1
    flags, message = frames[0]
    assert flags == 2
    error: dict[str, str] = message["error"]
    return error


START = "/process.Process/Start"
START_TRUE = envelope({"process": {"cmd": "/bin/true"}})


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        (b"\x00\x00", "invalid_argument", "incomplete envelope"),
        (struct.pack(">BI", 0, 100) + b"{}", "invalid_argument", "promised 100 bytes"),
        (envelope(b"{not json"), "invalid_argument", "unmarshal into StartRequest"),
        (envelope(b'{"process": {"cmd": 5}}'), "invalid_argument", "unmarshal"),
        (envelope(b"{}", flags=1), "internal", "compress"),
        (b"", "unimplemented", "zero messages"),
        (START_TRUE + START_TRUE, "unimplemented", "multiple messages"),
    ],
    ids=["short", "truncated", "json", "types", "compressed-flag", "empty", "two-messages"],
)
def test_malformed_stream_request(
    sandbox: Sandbox, envd_url: str, body: bytes, code: str, message: str
) -> None:
    with httpx.Client(base_url=envd_url) as client:
        error = _end_stream_error(client.post(START, content=body, headers=STREAM_HEADERS))
        assert error["code"] == code
        assert message in error["message"]
        # The same keep-alive connection still works.
        ok = client.post(START, content=START_TRUE, headers=STREAM_HEADERS)
        assert [f for f, _ in parse_envelopes(ok.content)][-1] == 2
    assert_envd_serves(sandbox, envd_url)


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/process.Process/List", b"{not json", 400, "invalid_argument"),
        ("/filesystem.Filesystem/Stat", b'{"path": 42}', 400, "invalid_argument"),
        ("/filesystem.Filesystem/Stat", b"[]", 400, "invalid_argument"),
        ("/filesystem.Filesystem/ListDir", b'{"path": "/", "depth": -1}', 400, "invalid_argument"),
        ("/process.Process/SendSignal", b'{"process": {"pid": 999999}}', 404, "not_found"),
        ("/process.Process/CloseStdin", b"{}", 400, "invalid_argument"),
        ("/filesystem.Filesystem/GetWatcherEvents", b'{"watcherId": "x"}', 404, "not_found"),
    ],
)
def test_bad_unary_requests(
    sandbox: Sandbox, envd_url: str, path: str, body: bytes, status: int, code: str
) -> None:
    with httpx.Client(base_url=envd_url) as client:
        response = client.post(path, content=body, headers=UNARY_HEADERS)
        assert response.status_code == status
        assert response.headers["content-type"] == "application/json"
        assert response.json()["code"] == code
        assert client.post("/process.Process/List", content=b"{}", headers=UNARY_HEADERS).is_success
    assert_envd_serves(sandbox, envd_url)


def test_unknown_fields_are_ignored(envd_url: str) -> None:
    response = httpx.post(
        f"{envd_url}/process.Process/List", content=b'{"future": 1}', headers=UNARY_HEADERS
    )
    assert response.status_code == 200


def test_unknown_methods_and_services(sandbox: Sandbox, envd_url: str) -> None:
    for path in ("/process.Process/Nope", "/filesystem.Filesystem/Nope", "/nope.Nope/Nope"):
        response = httpx.post(f"{envd_url}{path}", content=b"{}", headers=UNARY_HEADERS)
        assert response.status_code == 404
    assert_envd_serves(sandbox, envd_url)


def test_unsupported_rpc_content_types(sandbox: Sandbox, envd_url: str) -> None:
    list_url = f"{envd_url}/process.Process/List"
    assert (
        httpx.post(list_url, content=b"{}", headers={"Content-Type": "text/plain"}).status_code
        == 415
    )
    # A unary method called with streaming framing, and the other way round.
    assert httpx.post(list_url, content=envelope({}), headers=STREAM_HEADERS).status_code == 415
    start = httpx.post(
        f"{envd_url}{START}", content=b'{"process": {"cmd": "true"}}', headers=UNARY_HEADERS
    )
    assert start.status_code == 415
    assert httpx.get(list_url).status_code == 405
    assert_envd_serves(sandbox, envd_url)


@pytest.mark.parametrize("path", ["/tmp/nul\x00byte", "~root/x", "~other", "/tmp/" + "a" * 5000])
def test_bad_paths(sandbox: Sandbox, envd_url: str, path: str) -> None:
    with pytest.raises(InvalidArgumentException):
        sandbox.files.get_info(path)
    response = httpx.post(
        f"{envd_url}/filesystem.Filesystem/Stat",
        content=json.dumps({"path": path}).encode(),
        headers=UNARY_HEADERS,
    )
    assert (response.status_code, response.json()["code"]) == (400, "invalid_argument")
    download = httpx.get(f"{envd_url}/files", params={"path": path})
    assert download.status_code == 400
    assert_envd_serves(sandbox, envd_url)


def test_nul_byte_in_command(sandbox: Sandbox, envd_url: str) -> None:
    with pytest.raises(InvalidArgumentException):
        sandbox.commands.run("true", envs={"BAD": "a\x00b"})
    with pytest.raises(InvalidArgumentException):
        sandbox.commands.run("true", cwd="/tmp/\x00")
    assert_envd_serves(sandbox, envd_url)


def test_missing_paths(sandbox: Sandbox, envd_url: str, workdir: str) -> None:
    missing = f"{workdir}/missing"
    for call in (
        lambda: sandbox.files.read(missing),
        lambda: sandbox.files.get_info(missing),
        lambda: sandbox.files.list(missing),
        lambda: sandbox.files.rename(missing, f"{workdir}/x"),
        lambda: sandbox.files.watch_dir(missing),
    ):
        with pytest.raises(NotFoundException):
            call()
    response = httpx.get(f"{envd_url}/files", params={"path": missing})
    assert response.status_code == 404
    assert response.json() == {"code": 404, "message": f"path '{missing}' does not exist"}
    assert_envd_serves(sandbox, envd_url)


def test_permission_denied_for_user_command(sandbox: Sandbox, envd_url: str) -> None:
    with pytest.raises(CommandExitException) as info:
        sandbox.commands.run("touch /root/not-allowed")
    assert "Permission denied" in info.value.stderr
    with pytest.raises(CommandExitException):
        sandbox.commands.run("cat /etc/shadow", user="user")
    assert_envd_serves(sandbox, envd_url)


def test_unknown_user(sandbox: Sandbox, envd_url: str) -> None:
    with pytest.raises(AuthenticationException) as info:
        sandbox.commands.run("true", user="ghost")
    assert "invalid username: 'ghost'" in str(info.value)
    with pytest.raises(AuthenticationException):
        sandbox.files.list("/tmp", user="ghost")
    with pytest.raises(AuthenticationException):
        sandbox.files.read("/etc/hostname", user="ghost")
    with pytest.raises(AuthenticationException):
        sandbox.files.write("/tmp/ghost.txt", "g", user="ghost")
    # Basic auth is checked on every RPC, even those that do not act as the user.
    response = httpx.post(
        f"{envd_url}/process.Process/List",
        content=b"{}",
        headers={**UNARY_HEADERS, "Authorization": "Basic Z2hvc3Q6"},  # "ghost:"
    )
    assert response.status_code == 401
    assert response.json() == {"code": "unauthenticated", "message": "invalid username: 'ghost'"}
    stream = httpx.post(
        f"{envd_url}{START}",
        content=START_TRUE,
        headers={**STREAM_HEADERS, "Authorization": "Basic Z2hvc3Q6"},
    )
    assert _end_stream_error(stream)["code"] == "unauthenticated"
    download = httpx.get(f"{envd_url}/files", params={"path": "/etc/hostname", "username": "ghost"})
    assert download.status_code == 401
    assert_envd_serves(sandbox, envd_url)


def test_bad_process_requests(sandbox: Sandbox, envd_url: str) -> None:
    empty = httpx.post(
        f"{envd_url}{START}", content=envelope({"process": {"cmd": ""}}), headers=STREAM_HEADERS
    )
    assert _end_stream_error(empty)["code"] == "invalid_argument"
    missing = httpx.post(
        f"{envd_url}{START}",
        content=envelope({"process": {"cmd": "/no/such/binary"}}),
        headers=STREAM_HEADERS,
    )
    assert _end_stream_error(missing)["code"] == "invalid_argument"
    with pytest.raises(SandboxException):
        sandbox.commands.send_stdin(999_999, "x")
    # stdin was not requested: writing to it is refused, the process is unharmed.
    handle = sandbox.commands.run("sleep 1000", background=True)
    try:
        with pytest.raises(SandboxException):
            sandbox.commands.send_stdin(handle.pid, "x")
        assert handle.pid in {p.pid for p in sandbox.commands.list()}
    finally:
        handle.kill()
    assert_envd_serves(sandbox, envd_url)


def test_unsupported_upload_content_type_and_encoding(
    sandbox: Sandbox, envd_url: str, workdir: str
) -> None:
    url = f"{envd_url}/files"
    for headers in (
        {"Content-Type": "text/plain"},
        {},
        {"Content-Type": "multipart/form-data"},  # no boundary
        {"Content-Type": "application/octet-stream", "Content-Encoding": "br"},
        {"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},  # not gzip
    ):
        response = httpx.post(
            url, params={"path": f"{workdir}/u.txt"}, content=b"data", headers=headers
        )
        assert response.status_code == 400, headers
        assert response.json()["code"] == 400
    octet_without_path = httpx.post(
        url, content=b"x", headers={"Content-Type": "application/octet-stream"}
    )
    assert octet_without_path.status_code == 400
    assert httpx.post(url, files={"other": ("a", b"x")}).status_code == 400
    duplicate = httpx.post(
        url, files=[("file", (f"{workdir}/d", b"1")), ("file", (f"{workdir}/d", b"2"))]
    )
    assert duplicate.status_code == 400
    bad_metadata = httpx.post(
        url,
        params={"path": f"{workdir}/m"},
        content=b"x",
        headers={"Content-Type": "application/octet-stream", "X-Metadata-K": "tab\there"},
    )
    assert bad_metadata.status_code == 400
    assert not sandbox.files.exists(f"{workdir}/u.txt")
    assert_envd_serves(sandbox, envd_url)


def test_download_encodings(sandbox: Sandbox, envd_url: str, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/e.txt", "encoded")
    url = f"{envd_url}/files"
    params = {"path": f"{workdir}/e.txt"}
    plain = httpx.get(url, params=params, headers={"Accept-Encoding": "br"})
    assert (plain.status_code, plain.text) == (200, "encoded")
    assert "content-encoding" not in plain.headers
    gz = httpx.get(url, params=params, headers={"Accept-Encoding": "gzip"})
    assert (gz.status_code, gz.headers["content-encoding"], gz.text) == (200, "gzip", "encoded")
    refused = httpx.get(url, params=params, headers={"Accept-Encoding": "br, identity;q=0"})
    assert refused.status_code == 406
    assert refused.json()["code"] == 406
    ranged = httpx.get(url, params=params, headers={"Range": "bytes=2-4"})
    assert (ranged.status_code, ranged.text) == (206, "cod")
    assert_envd_serves(sandbox, envd_url)


@pytest.fixture(scope="module")
def small_upload_envd() -> Iterator[str]:
    with extra_envd("--max-upload-bytes", "1024") as url:
        yield url


@pytest.mark.parametrize("mode", ["multipart", "octet-stream", "chunked"])
def test_oversize_upload(small_upload_envd: str, mode: str) -> None:
    sandbox = sandbox_for(small_upload_envd)
    path = f"/home/user/big-{mode}.bin"
    data = b"x" * 4096
    payload: bytes | io.BytesIO = io.BytesIO(data) if mode == "chunked" else data
    with pytest.raises(SandboxException) as info:
        sandbox.files.write(path, payload, use_octet_stream=mode != "multipart")
    assert "1024 bytes" in str(info.value)
    assert not sandbox.files.exists(path)  # nothing half-written is left behind
    # Within the limit is fine, and the envd keeps serving.
    sandbox.files.write(path, b"y" * 1024, use_octet_stream=mode != "multipart")
    assert sandbox.files.get_info(path).size == 1024
    sandbox.files.remove(path)
    assert_envd_serves(sandbox, small_upload_envd)


def test_unsupported_signal(sandbox: Sandbox, envd_url: str) -> None:
    handle = sandbox.commands.run("sleep 1000", background=True)
    try:
        for signal in ("SIGNAL_UNSPECIFIED", 2):
            response = httpx.post(
                f"{envd_url}/process.Process/SendSignal",
                json={"process": {"pid": handle.pid}, "signal": signal},
                headers={"Connect-Protocol-Version": "1"},
            )
            assert response.status_code == 501
            assert response.json()["code"] == "unimplemented"
        assert handle.pid in {p.pid for p in sandbox.commands.list()}
    finally:
        handle.kill()
