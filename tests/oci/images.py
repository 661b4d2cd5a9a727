"""Test images written by hand: layer tars (any entry, including hostile ones) in an OCI image
layout, pushed to a registry with skopeo, which copies the blobs as they are."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TYPES = {
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
    "none": "application/vnd.oci.image.layer.v1.tar",
}


# One tar member: its header and, for regular files, its bytes.
Entry = tuple[tarfile.TarInfo, bytes | None]
# The `publish` fixture: images in, a fresh reference on the test registry out.
Publish = Callable[..., str]


def entry(
    name: str,
    data: bytes | None = None,
    *,
    kind: bytes = tarfile.REGTYPE,
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
    link: str = "",
    xattrs: dict[str, str] | None = None,
    dev: tuple[int, int] = (0, 0),
) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode, info.uid, info.gid, info.mtime = mode, uid, gid, 1_700_000_000
    info.linkname = link
    info.devmajor, info.devminor = dev
    if xattrs:
        info.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in xattrs.items()}
    if data is not None:
        info.size = len(data)
    return info, data


def directory(name: str, mode: int = 0o755, **kw: Any) -> tuple[tarfile.TarInfo, bytes | None]:
    return entry(name, kind=tarfile.DIRTYPE, mode=mode, **kw)


def symlink(name: str, target: str) -> tuple[tarfile.TarInfo, bytes | None]:
    return entry(name, kind=tarfile.SYMTYPE, link=target, mode=0o777)


def hardlink(name: str, target: str) -> tuple[tarfile.TarInfo, bytes | None]:
    return entry(name, kind=tarfile.LNKTYPE, link=target)


def tar_bytes(entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def compress(data: bytes, compression: str) -> bytes:
    if compression == "gzip":
        return gzip.compress(data, mtime=0)
    if compression == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    assert compression == "none", compression
    return data


@dataclass
class Image:
    layers: list[list[tuple[tarfile.TarInfo, bytes | None]]]
    compression: str = "gzip"
    architecture: str = "amd64"
    config: dict[str, Any] = field(default_factory=dict)
    wrong_diff_ids: bool = False  # a config whose diff_ids do not match the layers


class Layout:
    """An OCI image layout directory; `add` writes an image or an index of images under a tag."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (root / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
        self.index: list[dict[str, Any]] = []

    def blob(self, data: bytes, media_type: str) -> dict[str, Any]:
        digest = hashlib.sha256(data).hexdigest()
        (self.root / "blobs" / "sha256" / digest).write_bytes(data)
        return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}

    def image(self, image: Image) -> dict[str, Any]:
        descriptors, diff_ids = [], []
        for entries in image.layers:
            raw = tar_bytes(entries)
            seen = raw + b"!" if image.wrong_diff_ids else raw
            diff_ids.append(f"sha256:{hashlib.sha256(seen).hexdigest()}")
            packed = compress(raw, image.compression)
            descriptors.append(self.blob(packed, LAYER_TYPES[image.compression]))
        config = {
            "architecture": image.architecture,
            "os": "linux",
            "config": image.config,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": self.blob(json.dumps(config).encode(), OCI_CONFIG),
            "layers": descriptors,
        }
        desc = self.blob(json.dumps(manifest).encode(), OCI_MANIFEST)
        desc["platform"] = {"os": "linux", "architecture": image.architecture}
        return desc

    def add(self, tag: str, *images: Image) -> None:
        descs = [self.image(i) for i in images]
        if len(descs) == 1:
            top = descs[0]
        else:
            index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": descs}
            top = self.blob(json.dumps(index).encode(), OCI_INDEX)
        top = {**top, "annotations": {"org.opencontainers.image.ref.name": tag}}
        self.index.append(top)
        (self.root / "index.json").write_text(
            json.dumps({"schemaVersion": 2, "manifests": self.index})
        )


def push(layout: Layout, tag: str, dest: str, creds: str | None = None) -> None:
    """skopeo copy oci:LAYOUT:TAG docker://DEST (all platforms of an index, blobs unchanged)."""
    args = ["skopeo", "--insecure-policy", "copy", "--quiet", "--all", "--preserve-digests"]
    args.append("--dest-tls-verify=false")
    if creds:
        args.append(f"--dest-creds={creds}")
    args += [f"oci:{layout.root}:{tag}", f"docker://{dest}"]
    subprocess.run(args, check=True, capture_output=True, timeout=120)
