"""What a template build VM may reach: the package registries, nothing else.

RUN steps may use pip, npm and apt. The build VM's slot gets a domain egress policy
(`network.egress_proxy`): every other destination is denied, connections are judged by the
name they ask for (TLS SNI or HTTP Host), and DNS answers only the allowed names, from the
node's resolver. So a build reaches the registries exactly as the host does (its resolver,
its route, whatever proxy sits on that route) and nothing else, while ordinary sandboxes keep
their own policies: this one belongs to build VMs only.

Where the host reaches the registries through a TLS-intercepting proxy, the guest must trust
that proxy's CA as the host does: the host's CA bundle is written into the build VM for the
build's RUN steps (pointed at by the env vars pip, npm, curl and OpenSSL read) and removed
before the template is saved, so no sandbox of the template inherits it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from aenv.config import REGISTRIES
from aenv.network.settings import ALL_TRAFFIC, SandboxNetwork

GUEST_CA_DIR = "/etc/aenv-build"
GUEST_CA = f"{GUEST_CA_DIR}/ca-certificates.crt"
# OpenSSL (python, curl), pip, requests, curl and node each read their own.
_CA_ENV = (
    "SSL_CERT_FILE",
    "PIP_CERT",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
)


@dataclass(frozen=True)
class BuildEgress:
    # Names (`*.` wildcards too) a build may reach; none: the build VM has no network.
    hosts: tuple[str, ...] = REGISTRIES
    # PEM certificates the RUN steps trust (the host's bundle); None leaves the image's own.
    ca_bundle: Path | None = None

    @classmethod
    def for_node(
        cls, hosts: tuple[str, ...], ca_bundle: Path | None, debian_mirror: str
    ) -> BuildEgress:
        """The registries plus the host of the Debian mirror the base template's apt uses."""
        mirror = urlsplit(debian_mirror).hostname
        names = (*hosts, mirror) if mirror else hosts
        return cls(tuple(dict.fromkeys(names)), ca_bundle)

    def network(self) -> SandboxNetwork:
        if not self.hosts:
            return SandboxNetwork(allow_internet=False)
        return SandboxNetwork(allow_out=self.hosts, deny_out=(ALL_TRAFFIC,))

    def step_env(self) -> dict[str, str]:
        """Env vars of RUN steps (a step's own ENV wins)."""
        if self.ca_bundle is None:
            return {}
        return dict.fromkeys(_CA_ENV, GUEST_CA)
