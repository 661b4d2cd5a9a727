"""Access tokens and signed `/files` URLs, against a second envd started with --access-token
(the session envd stays open). The SDK is built as for a secured sandbox: X-Access-Token on
every request, signed download/upload URLs."""

from __future__ import annotations

import secrets
import urllib.parse
from collections.abc import Iterator

import httpx
import pytest
from e2b import AuthenticationException, Sandbox

from tests.envd.helpers import UNARY_HEADERS, async_sandbox_for, extra_envd, sandbox_for

TOKEN = secrets.token_urlsafe(24)
UNAUTHORIZED = {
    "code": 401,
    "message": "unauthorized access, please provide a valid access token or method signing "
    "if supported",
}


@pytest.fixture(scope="module")
def secured_url() -> Iterator[str]:
    with extra_envd(f"--access-token={TOKEN}") as url:
        yield url


@pytest.fixture
def secured(secured_url: str) -> Sandbox:
    return sandbox_for(secured_url, TOKEN)


def test_sdk_with_token_works(secured: Sandbox) -> None:
    assert secured.commands.run("id -un").stdout == "user\n"
    secured.files.write("/home/user/secured.txt", "s")
    assert secured.files.read("/home/user/secured.txt") == "s"
    assert "secured.txt" in {e.name for e in secured.files.list("/home/user")}
    handle = secured.files.watch_dir("/home/user")
    handle.stop()
    secured.files.remove("/home/user/secured.txt")


async def test_async_sdk_with_token_works(secured_url: str) -> None:
    sandbox = async_sandbox_for(secured_url, TOKEN)
    assert (await sandbox.commands.run("echo async")).stdout == "async\n"
    assert await sandbox.files.exists("/home/user")


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_sdk_without_valid_token_is_rejected(secured_url: str, token: str | None) -> None:
    sandbox = sandbox_for(secured_url, None)
    if token is not None:
        sandbox = sandbox_for(secured_url, token)
    with pytest.raises(AuthenticationException):
        sandbox.commands.run("true")
    with pytest.raises(AuthenticationException):
        sandbox.files.list("/home/user")
    with pytest.raises(AuthenticationException):
        sandbox.commands.list()


@pytest.mark.parametrize(
    "headers",
    [{}, {"X-Access-Token": "wrong"}, {"X-Access-Token": ""}, {"x-access-token": TOKEN[:-1]}],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/process.Process/List"),
        ("POST", "/filesystem.Filesystem/Stat"),
        ("GET", "/envs"),
        ("GET", "/metrics"),
        ("POST", "/process.Process/NoSuchMethod"),
    ],
)
def test_raw_requests_without_token_get_exact_401(
    secured_url: str, method: str, path: str, headers: dict[str, str]
) -> None:
    response = httpx.request(
        method,
        f"{secured_url}{path}",
        headers={**UNARY_HEADERS, **headers},
        content=b"{}" if method == "POST" else None,
    )
    assert response.status_code == 401
    assert response.json() == UNAUTHORIZED


def test_health_needs_no_token(secured_url: str) -> None:
    assert httpx.get(f"{secured_url}/health").status_code == 204


def test_correct_token_opens_raw_routes(secured_url: str) -> None:
    response = httpx.post(
        f"{secured_url}/process.Process/List",
        headers={**UNARY_HEADERS, "X-Access-Token": TOKEN},
        content=b"{}",
    )
    assert response.status_code == 200
    assert httpx.get(f"{secured_url}/envs", headers={"X-Access-Token": TOKEN}).status_code == 200


def test_files_without_token_or_signature(secured_url: str) -> None:
    r = httpx.get(f"{secured_url}/files", params={"path": "/home/user"})
    assert r.status_code == 401
    assert r.json() == {"code": 401, "message": "missing signature query parameter"}
    r = httpx.get(
        f"{secured_url}/files", params={"path": "/etc/hostname"}, headers={"X-Access-Token": "x"}
    )
    assert r.status_code == 401
    assert r.json() == {
        "code": 401,
        "message": "access token present in header but does not match",
    }


def test_signed_download_url(secured: Sandbox) -> None:
    secured.files.write("/home/user/signed.txt", "signed content")
    try:
        for user in (None, "user"):
            url = secured.download_url("/home/user/signed.txt", user=user)
            assert "signature=v1_" in url
            response = httpx.get(url)
            assert response.status_code == 200, response.text
            assert response.text == "signed content"
        with_expiry = secured.download_url("signed.txt", "user", use_signature_expiration=120)
        assert "signature_expiration=" in with_expiry
        response = httpx.get(with_expiry)
        assert response.status_code == 200
        assert response.text == "signed content"
    finally:
        secured.files.remove("/home/user/signed.txt")


def test_signed_upload_url(secured: Sandbox) -> None:
    for expiration in (None, 300):
        url = secured.upload_url("/home/user/up/signed.txt", use_signature_expiration=expiration)
        response = httpx.post(url, files={"file": ("signed.txt", b"uploaded by url")})
        assert response.status_code == 200, response.text
        assert response.json()[0]["path"] == "/home/user/up/signed.txt"
        assert secured.files.read("/home/user/up/signed.txt") == "uploaded by url"
    assert secured.files.get_info("/home/user/up/signed.txt").owner == "user"
    secured.files.remove("/home/user/up")


def test_expired_signature(secured: Sandbox) -> None:
    secured.files.write("/home/user/exp.txt", "x")
    try:
        url = secured.download_url("/home/user/exp.txt", "user", use_signature_expiration=-120)
        response = httpx.get(url)
        assert response.status_code == 401
        assert response.json() == {"code": 401, "message": "signature is already expired"}
        upload = secured.upload_url("/home/user/exp.txt", use_signature_expiration=-120)
        response = httpx.post(upload, files={"file": ("exp.txt", b"y")})
        assert response.status_code == 401
        assert response.json() == {"code": 401, "message": "signature is already expired"}
    finally:
        secured.files.remove("/home/user/exp.txt")


def _tamper(url: str, **changes: str) -> str:
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    query.update(changes)
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


def test_invalid_signatures(secured: Sandbox) -> None:
    secured.files.write("/home/user/inv.txt", "x")
    try:
        url = secured.download_url("/home/user/inv.txt", "user", use_signature_expiration=120)
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))
        invalid = {"code": 401, "message": "invalid signature"}
        for bad in (
            _tamper(url, signature="v1_" + "A" * 43),
            _tamper(url, path="/home/user/other.txt"),  # signed for another path
            _tamper(url, username="root"),  # signed for another user
            _tamper(url, signature_expiration=str(int(query["signature_expiration"]) + 1)),
        ):
            response = httpx.get(bad)
            assert response.status_code == 401
            assert response.json() == invalid
        # A read signature does not authorize a write.
        write = _tamper(url)
        response = httpx.post(write, files={"file": ("inv.txt", b"nope")})
        assert response.status_code == 401
        assert response.json() == invalid
        assert secured.files.read("/home/user/inv.txt") == "x"
    finally:
        secured.files.remove("/home/user/inv.txt")


def test_init_with_token_changes_token(secured_url: str) -> None:
    # /init is open, but with a token configured it must carry the current one to change it.
    denied = httpx.post(f"{secured_url}/init", json={"accessToken": "stolen"})
    assert denied.status_code == 401
    assert sandbox_for(secured_url, TOKEN).commands.run("echo same").stdout == "same\n"


def test_signed_urls_with_unusual_paths(secured: Sandbox) -> None:
    path = "/home/user/dir with space/ünï&code=1?.txt"
    secured.files.write(path, "odd")
    try:
        response = httpx.get(secured.download_url(path, "user", use_signature_expiration=60))
        assert response.status_code == 200, response.text
        assert response.text == "odd"
        relative = "dir with space/ünï&code=1?.txt"
        response = httpx.get(secured.download_url(relative))
        assert (response.status_code, response.text) == (200, "odd")
    finally:
        secured.files.remove("/home/user/dir with space")


def test_cors_preflight_needs_no_token(secured_url: str) -> None:
    preflight = httpx.options(
        f"{secured_url}/filesystem.Filesystem/ListDir",
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "x-access-token",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "*"
    denied = httpx.post(
        f"{secured_url}/filesystem.Filesystem/ListDir",
        content=b"{}",
        headers={**UNARY_HEADERS, "Origin": "https://app.example"},
    )
    assert denied.status_code == 401
    assert denied.headers["access-control-allow-origin"] == "*"  # the browser may read the error
