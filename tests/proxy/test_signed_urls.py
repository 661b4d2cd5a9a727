"""The SDK's `download_url()`/`upload_url()` with `E2B_SANDBOX_URL` naming the node: URLs that
name no sandbox, fetched by a plain HTTP client, reach the envd whose token signed them."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from aenv.proxy import SandboxProxy
from aenv.proxy.signed import signer
from tests.proxy.conftest import ENVD, sdk_sandbox
from tests.proxy.support import WAIT, DictResolver, FakeSandbox, serve
from tests.support.envd_process import envd_in_throwaway_root
from tests.support.ports import free_port

TOKENS = {"signedsandbox0000001": "first-envd-token", "signedsandbox0000002": "other-token"}


@pytest.fixture(scope="module")
def node_url() -> Iterator[str]:
    """A proxy (no domain, as a node without one) before two envds, each with its token."""
    resolver = DictResolver()
    ports = {sandbox_id: free_port() for sandbox_id in TOKENS}
    first, second = TOKENS
    with (
        envd_in_throwaway_root(ports[first], f"--access-token={TOKENS[first]}"),
        envd_in_throwaway_root(ports[second], f"--access-token={TOKENS[second]}"),
    ):
        for sandbox_id, port in ports.items():
            resolver.sandboxes[sandbox_id] = FakeSandbox({ENVD: port})
        proxy = SandboxProxy(resolver, signer=lambda signed: signer(signed, TOKENS.items()))
        with serve(proxy, free_port()) as url:
            yield url


def _sandbox(node_url: str, sandbox_id: str) -> Sandbox:
    return sdk_sandbox(node_url, sandbox_id, TOKENS[sandbox_id])


def test_download_and_upload_urls_reach_the_signing_sandbox(node_url: str) -> None:
    first, second = (_sandbox(node_url, sandbox_id) for sandbox_id in TOKENS)
    first.files.write("/tmp/which.txt", "first")
    second.files.write("/tmp/which.txt", "second")
    for sandbox, content in ((first, "first"), (second, "second")):
        url = sandbox.download_url("/tmp/which.txt")
        assert url.startswith(f"{node_url}/files?")  # no sandbox named in it
        assert httpx.get(url, timeout=WAIT).text == content
    upload = second.upload_url("/tmp/uploaded.txt", use_signature_expiration=600)
    sent = httpx.post(upload, files={"file": ("uploaded.txt", b"sent plainly")}, timeout=WAIT)
    assert sent.status_code == 200, sent.text
    assert second.files.read("/tmp/uploaded.txt") == "sent plainly"
    assert not first.files.exists("/tmp/uploaded.txt")


def test_expired_and_foreign_signatures(node_url: str) -> None:
    sandbox = _sandbox(node_url, "signedsandbox0000001")
    sandbox.files.write("/tmp/expiring.txt", "x")
    # The signature matches, so the request reaches envd, which refuses it as E2B's does.
    expired = sandbox.download_url("/tmp/expiring.txt", use_signature_expiration=-10)
    answer = httpx.get(expired, timeout=WAIT)
    assert answer.status_code == 401
    assert answer.json()["message"] == "signature is already expired"
    # No sandbox's token made this one: it is not routed (the node's own JSON 404 here).
    forged = sandbox.download_url("/tmp/expiring.txt").replace("signature=v1_", "signature=v1_x")
    assert httpx.get(forged, timeout=WAIT).status_code == 404
