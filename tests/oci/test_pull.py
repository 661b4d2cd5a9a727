"""Pulling from a real registry: manifest lists, media types and compressions, the shared blob
cache, resumed downloads, verification, and errors that say what went wrong."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from aenv.oci import (
    DigestMismatchError,
    NotFoundError,
    Platform,
    PlatformNotFoundError,
    PullProgress,
    ReferenceError,
    pull,
)
from aenv.oci.unpack import apply_layer
from tests.oci.conftest import simple_image
from tests.oci.images import Image, Publish, entry
from tests.oci.registry import Registry


async def test_pull_fills_the_blob_cache(publish: Publish, tmp_path: Path) -> None:
    ref = publish(simple_image(config={"Env": ["A=1"], "Cmd": ["sh"]}))
    seen: list[PullProgress] = []
    image = await pull(ref, tmp_path / "oci", progress=seen.append)
    assert image.config["config"]["Env"] == ["A=1"]
    (layer,) = image.layers
    path = tmp_path / "oci" / "blobs" / "sha256" / layer.digest.removeprefix("sha256:")
    assert image.layer_path(layer) == path and path.stat().st_size == layer.size
    assert seen[-1] == PullProgress(layer.digest, layer.size, layer.size)
    again = await pull(ref, tmp_path / "oci")
    assert again.digest == image.digest
    assert not list(path.parent.glob("*.partial"))


async def test_manifest_list_selects_the_platform(publish: Publish, tmp_path: Path) -> None:
    ref = publish(
        simple_image(b"amd64\n", architecture="amd64"),
        simple_image(b"arm64\n", architecture="arm64"),
    )
    for arch in ("amd64", "arm64"):
        image = await pull(ref, tmp_path / "oci", platform=Platform("linux", arch))
        assert image.index_digest is not None and image.config["architecture"] == arch
        tree = tmp_path / arch
        tree.mkdir()
        apply_layer(tree, image.layer_path(image.layers[0]))
        assert (tree / "etc" / "greeting").read_text() == f"{arch}\n"
    assert (await pull(ref, tmp_path / "oci")).platform == Platform("linux", "amd64")
    with pytest.raises(PlatformNotFoundError, match=r"linux/riscv64.*linux/amd64, linux/arm64"):
        await pull(ref, tmp_path / "oci", platform=Platform("linux", "riscv64"))


@pytest.mark.parametrize("compression", ["gzip", "zstd", "none"])
async def test_layer_compressions(publish: Publish, tmp_path: Path, compression: str) -> None:
    image = await pull(publish(simple_image(compression=compression)), tmp_path / "oci")
    assert image.layers[0].media_type.endswith({"none": "tar"}.get(compression, compression))
    apply_layer(tmp_path, image.layer_path(image.layers[0]))
    assert (tmp_path / "etc" / "greeting").read_text() == "hello\n"


async def test_pull_by_digest(publish: Publish, tmp_path: Path) -> None:
    ref = publish(simple_image())
    digest = (await pull(ref, tmp_path / "oci")).digest
    by_digest = ref.rsplit(":", 1)[0] + f"@{digest}"
    assert (await pull(by_digest, tmp_path / "oci")).digest == digest


async def test_cached_blobs_are_not_downloaded_again(
    publish: Publish, registry: Registry, tmp_path: Path
) -> None:
    ref = publish(simple_image(b"cached\n"))
    first = await pull(ref, tmp_path / "oci")
    # The registry loses the layer: a second pull into the same cache does not need it.
    registry.blob_file(first.layers[0].digest).unlink()
    second = await pull(ref, tmp_path / "oci")
    assert second.layers == first.layers
    with pytest.raises(NotFoundError):
        await pull(ref, tmp_path / "other-cache")


async def test_partial_download_is_resumed(
    publish: Publish, registry: Registry, tmp_path: Path
) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB, so the layer is worth resuming
    ref = publish(simple_image(payload, compression="none"))
    good = await pull(ref, tmp_path / "reference")
    layer = good.layers[0]
    blob = good.layer_path(layer).read_bytes()
    cache = tmp_path / "oci" / "blobs" / "sha256"
    cache.mkdir(parents=True)
    partial = cache / f"{layer.digest.removeprefix('sha256:')}.partial"

    # Right first half: the rest comes from a Range request and the blob is whole.
    partial.write_bytes(blob[: len(blob) // 2])
    seen: list[PullProgress] = []
    resumed = await pull(ref, tmp_path / "oci", progress=seen.append)
    assert resumed.layer_path(layer).read_bytes() == blob and not partial.exists()
    assert next(p.done for p in seen if p.digest == layer.digest) == len(blob) // 2

    # Wrong first half: proof the partial is really continued, not re-fetched; it is dropped.
    resumed.layer_path(layer).unlink()
    partial.write_bytes(b"x" * (len(blob) // 2))
    with pytest.raises(DigestMismatchError, match=layer.digest):
        await pull(ref, tmp_path / "oci")
    assert not partial.exists() and not resumed.layer_path(layer).exists()
    assert (await pull(ref, tmp_path / "oci")).layer_path(layer).read_bytes() == blob

    # Whole but not yet committed (a crash between the last byte and the rename): no request.
    resumed.layer_path(layer).rename(partial)
    registry.blob_file(layer.digest).unlink()
    assert (await pull(ref, tmp_path / "oci")).layer_path(layer).read_bytes() == blob


async def test_tampered_blob_in_the_registry(
    publish: Publish, registry: Registry, tmp_path: Path
) -> None:
    ref = publish(simple_image(b"original\n", compression="none"))
    layer = (await pull(ref, tmp_path / "probe")).layers[0]
    stored = registry.blob_file(layer.digest)
    stored.write_bytes(stored.read_bytes().replace(b"original", b"tampered"))
    with pytest.raises(DigestMismatchError, match=f"expected {layer.digest}"):
        await pull(ref, tmp_path / "oci")
    hex_ = layer.digest.removeprefix("sha256:")
    assert not list((tmp_path / "oci" / "blobs" / "sha256").glob(f"{hex_}*"))


async def test_tampered_manifest(publish: Publish, registry: Registry, tmp_path: Path) -> None:
    ref = publish(simple_image())
    image = await pull(ref, tmp_path / "probe")
    stored = registry.blob_file(image.digest)
    doc = json.loads(stored.read_bytes())
    doc["annotations"] = {"evil": "yes"}
    stored.write_text(json.dumps(doc))
    by_digest = ref.rsplit(":", 1)[0] + f"@{image.digest}"
    with pytest.raises(DigestMismatchError, match="manifest"):
        await pull(by_digest, tmp_path / "oci")


async def test_unknown_image_and_tag(publish: Publish, registry: Registry, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match=rf"{registry.host}/test/nothing-here:v1: not found"):
        await pull(f"{registry.host}/test/nothing-here:v1", tmp_path)
    ref = publish(simple_image())
    with pytest.raises(NotFoundError, match="MANIFEST_UNKNOWN"):
        await pull(ref.rsplit(":", 1)[0] + ":no-such-tag", tmp_path)


def test_bad_reference() -> None:
    from aenv.oci.reference import parse

    for bad in ("UPPER/case", "x@sha256:short", "a:b:c", ""):
        with pytest.raises(ReferenceError):
            parse(bad)
    assert str(parse("alpine")) == "docker.io/library/alpine:latest"
    assert parse("localhost:5000/a/b@sha256:" + "0" * 64).base_url == "http://localhost:5000"
    assert parse("ghcr.io/x/y:1").base_url == "https://ghcr.io"
    assert parse("docker.io/x/y").base_url == "https://registry-1.docker.io"


async def test_concurrent_pulls_share_the_cache(publish: Publish, tmp_path: Path) -> None:
    layers = [[entry(f"layer{i}", bytes([i]) * (256 << 10))] for i in range(5)]
    ref = publish(Image(layers))
    pulls = await asyncio.gather(*(pull(ref, tmp_path / "oci") for _ in range(3)))
    assert len({p.digest for p in pulls}) == 1 and len(pulls[0].layers) == 5
    blobs = tmp_path / "oci" / "blobs" / "sha256"
    assert sorted(p.name for p in blobs.iterdir()) == sorted(
        [layer.digest[7:] for layer in pulls[0].layers] + [pulls[0].config_digest[7:]]
    )
