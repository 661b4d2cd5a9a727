"""Image references (`[registry/]repository[:tag][@digest]`) parsed the way docker does:
a first component with a dot, a colon or `localhost` names the registry, else Docker Hub."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from aenv.oci.errors import ImageError

DOCKER_HUB = "docker.io"
# Docker Hub's API lives on another host than its name.
_HUB_API = "registry-1.docker.io"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


class ReferenceError(ImageError, ValueError):
    """The string is not an image reference."""


@dataclass(frozen=True)
class Reference:
    registry: str  # host[:port] as written (docker.io for Docker Hub)
    repository: str
    tag: str | None
    digest: str | None

    @property
    def reference(self) -> str:
        """What to ask the manifests endpoint for: the digest when pinned, else the tag."""
        return self.digest or self.tag or "latest"

    @property
    def api_host(self) -> str:
        return _HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def base_url(self) -> str:
        """Plain HTTP for loopback registries only, as docker treats them (insecure by default)."""
        scheme = "http" if _is_loopback(urlsplit(f"//{self.api_host}").hostname or "") else "https"
        return f"{scheme}://{self.api_host}"

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def parse(ref: str) -> Reference:
    name, _, digest = ref.partition("@")
    if digest and not _DIGEST.match(digest):
        raise ReferenceError(f"{ref!r}: digest must be sha256:<64 hex>")
    tag: str | None = None
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
        if not _TAG.match(tag):
            raise ReferenceError(f"{ref!r}: bad tag {tag!r}")
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, repository = first, rest
    else:
        registry, repository = DOCKER_HUB, name
    if registry == DOCKER_HUB and "/" not in repository:
        repository = f"library/{repository}"
    if not _REPOSITORY.match(repository):
        raise ReferenceError(f"{ref!r}: bad repository name {repository!r}")
    if tag is None and not digest:
        tag = "latest"
    return Reference(registry, repository, tag, digest or None)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
