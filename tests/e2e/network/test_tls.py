"""The node over HTTPS by its domain alone (E2B_DOMAIN, no E2B_SANDBOX_URL): the SDK's calls, and
signed download and upload URLs used by a plain HTTP client, with and without expiration."""

from __future__ import annotations

import httpx
from e2b import Sandbox

from tests.e2e.network.conftest import sandbox_url

ENVD_PORT = 49983


def test_signed_urls_from_any_client() -> None:
    sandbox = Sandbox.create(timeout=120)
    try:
        # Everything the SDK did so far went to https://api.<domain> and the sandbox's host.
        assert sandbox.envd_direct_url == sandbox_url(sandbox.sandbox_id, ENVD_PORT)
        sandbox.files.write("/home/user/a.txt", "from the sdk")

        download = sandbox.download_url("/home/user/a.txt")
        assert download.startswith(sandbox_url(sandbox.sandbox_id, ENVD_PORT) + "/files?")
        answer = httpx.get(download, timeout=30)
        assert (answer.status_code, answer.text) == (200, "from the sdk")

        upload = sandbox.upload_url("/home/user/b.txt", use_signature_expiration=120)
        sent = httpx.post(upload, files={"file": ("b.txt", b"from a client")}, timeout=30)
        assert sent.status_code == 200, sent.text
        assert sandbox.files.read("/home/user/b.txt") == "from a client"
        # A signature is for its path and operation only.
        elsewhere = upload.replace("b.txt", "c.txt")
        assert httpx.post(elsewhere, files={"file": ("c", b"x")}, timeout=30).status_code == 401

        # Expired an hour ago: envd judges by the guest's clock, which a restored TCG guest may
        # have a few seconds behind, so a signature expiring in a second is no test.
        expired = sandbox.download_url("/home/user/a.txt", use_signature_expiration=-3600)
        assert httpx.get(expired, timeout=30).status_code == 401
    finally:
        sandbox.kill()
