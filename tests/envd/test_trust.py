"""The node's egress CA installed into a guest's trust (`aenv.envd.trust`), under a root of
the test's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme

from aenv.envd import trust

SYSTEM = "etc/ssl/certs/ca-certificates.crt"


def test_the_ca_joins_the_system_bundle_once(tmp_path: Path) -> None:
    origin = trustme.CA().cert_pem.bytes().decode()
    (tmp_path / SYSTEM).parent.mkdir(parents=True)
    (tmp_path / SYSTEM).write_text(origin)
    ca = trustme.CA().cert_pem.bytes().decode()
    variables = trust.install(ca, tmp_path)
    assert variables == trust.variables(tmp_path)
    assert (tmp_path / trust.CA_FILE).read_text() == ca
    assert (tmp_path / SYSTEM).read_text() == origin + ca
    assert (tmp_path / trust.BUNDLE_FILE).read_text() == origin + ca
    # Every restore installs it again: nothing is added twice.
    trust.install(ca, tmp_path)
    assert (tmp_path / SYSTEM).read_text() == origin + ca
    # Another node's CA (a resume elsewhere) joins the first.
    other = trustme.CA().cert_pem.bytes().decode()
    trust.install(other, tmp_path)
    assert (tmp_path / trust.BUNDLE_FILE).read_text() == origin + ca + other
    assert (tmp_path / trust.CA_FILE).read_text() == other


def test_an_image_without_a_bundle_and_what_is_not_a_certificate(tmp_path: Path) -> None:
    ca = trustme.CA().cert_pem.bytes().decode()
    trust.install(ca, tmp_path)
    assert (tmp_path / trust.BUNDLE_FILE).read_text() == ca
    assert not (tmp_path / SYSTEM).exists()
    for bad in ("", "hello", ca + ca, "-----BEGIN PRIVATE KEY-----\nx\n-----END PRIVATE KEY-----"):
        with pytest.raises(ValueError):
            trust.install(bad, tmp_path / "other")
