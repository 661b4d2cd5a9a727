"""The node's egress CA in the guest's trust: how a sandbox with header rules (E2B's
`network.rules`) trusts the certificates its slot's egress proxy shows for ruled names.

The host sends the CA's certificate (never its key) after every `/init` of such a sandbox:
at create, resume and fork, so a sandbox restored on another node trusts that node's CA too.
It is written to `CA_FILE`, appended to the distribution's bundle (which clients read by
default: curl, OpenSSL, Go) unless already there, and copied with that bundle to
`BUNDLE_FILE`. The usual variables name them for clients that read their own store (Python
requests, Node): set in envd's default env, under the sandbox's own values.
"""

from __future__ import annotations

from pathlib import Path

CA_FILE = "etc/aenv/egress-ca.pem"
BUNDLE_FILE = "etc/aenv/ca-bundle.pem"
# Debian, Ubuntu and Alpine; Fedora and RHEL; what OpenSSL builds default to.
SYSTEM_BUNDLES = (
    "etc/ssl/certs/ca-certificates.crt",
    "etc/pki/tls/certs/ca-bundle.crt",
    "etc/ssl/cert.pem",
)


def variables(root: Path = Path("/")) -> dict[str, str]:
    bundle, ca = str(root / BUNDLE_FILE), str(root / CA_FILE)
    return {
        "SSL_CERT_FILE": bundle,
        "REQUESTS_CA_BUNDLE": bundle,
        "CURL_CA_BUNDLE": bundle,
        "NODE_EXTRA_CA_CERTS": ca,
    }


def install(certificate: str, root: Path = Path("/")) -> dict[str, str]:
    """Trust `certificate` (PEM) under `root`; returns the variables that name it. ValueError
    if it is not one PEM certificate."""
    pem = certificate.strip() + "\n"
    if not pem.startswith("-----BEGIN CERTIFICATE-----") or pem.count("-----BEGIN") != 1:
        raise ValueError("not a PEM certificate")
    ca = root / CA_FILE
    ca.parent.mkdir(parents=True, exist_ok=True)
    ca.write_text(pem)
    bundle = ""
    for name in SYSTEM_BUNDLES:
        path = root / name
        if path.is_file():
            bundle = path.read_text()
            if pem not in bundle:
                bundle = bundle.rstrip("\n") + "\n" + pem if bundle.strip() else pem
                path.write_text(bundle)
            break
    (root / BUNDLE_FILE).write_text(bundle if pem in bundle else bundle + pem)
    return variables(root)
