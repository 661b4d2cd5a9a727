"""COPY uploads of template builds on a node of doubles: archives made and hashed by the E2B
SDK's own code (`e2b.template.utils`), streamed to disk and from it into the build VM, refused
whole when they are not a tar, do not match their digest header or do not fit above the disk
reserve, removed when a build finds they do not match their files hash, when unused for a
day, and with their template."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
import tracemalloc
from base64 import b64encode
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from e2b.template.utils import calculate_files_hash, tar_file_stream

from aenv.orchestrator.build_files import UNUSED_FOR
from aenv.orchestrator.reserve import HostReserve
from tests.api.conftest import BuildNode, build, request

pytestmark = pytest.mark.timeout(300)


def archive(context: Path, src: str, dest: str) -> tuple[str, bytes]:
    """(files hash, gzip tar) of `COPY src dest`, as the SDK computes and uploads them."""
    files_hash = calculate_files_hash(src, dest, str(context), [], False, None)
    with tar_file_stream(src, str(context), [], False, True) as tar:
        return files_hash, tar.read()


async def chunks_of(path: Path) -> AsyncIterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(1 << 16):
            yield chunk


async def one_chunk(data: bytes) -> AsyncIterator[bytes]:
    """`data` sent chunked: the request declares no length."""
    yield data


async def test_a_large_copy_streams_from_upload_to_the_vm(build_node: BuildNode) -> None:
    """Upload and build hold a chunk at a time: Python's peak allocation stays far under the
    archive's size (it held the archive whole, several times, in the build)."""
    data = build_node.context / "data.bin"
    with data.open("wb") as f:
        for _ in range(32):
            f.write(os.urandom(1 << 20))
    files_hash = calculate_files_hash("data.bin", "/opt/", str(build_node.context), [], False, None)
    tarball = build_node.context.parent / "upload.tar"
    # `gzip=False`: the SDK's plain tar, as large as its files, and no CPU spent compressing.
    with tar_file_stream("data.bin", str(build_node.context), [], False, False) as tar:
        tarball.write_bytes(tar.read())
    size = tarball.stat().st_size
    ids = await request(build_node, "large")
    template_id = ids[0]
    url = f"/templates/{template_id}/files/{files_hash}"
    tracemalloc.start()
    try:
        assert (await build_node.client.get(url)).json()["present"] is False
        put = await build_node.client.put(
            url, content=chunks_of(tarball), headers={"content-length": str(size)}
        )
        assert put.status_code == 201, put.text
        copy = {"type": "COPY", "args": ["data.bin", "/opt/"], "filesHash": files_hash}
        status = await build(build_node, ids, [copy])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size > 32 << 20
    assert peak < 12 << 20, f"peak {peak >> 20} MiB for a {size >> 20} MiB archive"
    assert status["status"] == "ready", status


async def test_a_copy_uses_the_sdks_files_hash(build_node: BuildNode) -> None:
    (build_node.context / "app").mkdir()
    (build_node.context / "app" / "main.py").write_text("print('hi')\n")
    files_hash, tar = archive(build_node.context, "app", "/srv/")
    ids = await request(build_node, "app")
    template_id = ids[0]
    put = await build_node.client.put(f"/templates/{template_id}/files/{files_hash}", content=tar)
    assert put.status_code == 201, put.text
    copy = {"type": "COPY", "args": ["app", "/srv/"], "filesHash": files_hash}
    status = await build(build_node, ids, [copy])
    assert status["status"] == "ready", status
    assert build_node.builder.files.path(template_id, files_hash).is_file()


async def test_an_upload_not_matching_its_files_hash_is_removed_by_the_build(
    build_node: BuildNode,
) -> None:
    """The SDK's hash covers the step's paths, which the upload does not carry: the build
    checks it, and drops the upload, so that the SDK's next files query asks for it again."""
    (build_node.context / "a.txt").write_text("a\n")
    _, tar = archive(build_node.context, "a.txt", "/srv/")
    wrong = hashlib.sha256(b"other").hexdigest()
    ids = await request(build_node, "wrong")
    template_id = ids[0]
    url = f"/templates/{template_id}/files/{wrong}"
    assert (await build_node.client.put(url, content=tar)).status_code == 201
    assert (await build_node.client.get(url)).json()["present"] is True
    copy = {"type": "COPY", "args": ["a.txt", "/srv/"], "filesHash": wrong}
    status = await build(build_node, ids, [copy])
    assert status["status"] == "error"
    assert "do not match filesHash" in status["reason"]["message"]
    assert (await build_node.client.get(url)).json()["present"] is False


async def test_uploads_are_checked_as_they_stream(build_node: BuildNode) -> None:
    (build_node.context / "a.txt").write_text("a\n")
    files_hash, tar = archive(build_node.context, "a.txt", "/srv/")
    ids = await request(build_node, "checked")
    template_id = ids[0]
    url = f"/templates/{template_id}/files/{files_hash}"
    good = "sha-256=:" + b64encode(hashlib.sha256(tar).digest()).decode() + ":"
    bad = "sha-256=:" + b64encode(hashlib.sha256(b"x").digest()).decode() + ":"
    refused = [
        await build_node.client.put(url, content=b"not a tar archive" * 100),
        await build_node.client.put(url, content=tar, headers={"content-digest": bad}),
        await build_node.client.put(url, content=tar, headers={"repr-digest": "sha-256=:abc:"}),
    ]
    for response in refused:
        assert response.status_code == 400, response.text
        assert response.json()["code"] == 400
    assert "not a tar" in refused[0].json()["message"]
    assert "sha-256" in refused[1].json()["message"]
    directory = build_node.builder.files.path(template_id, files_hash).parent
    assert list(directory.iterdir()) == []  # nothing kept, not even a partial file
    accepted = await build_node.client.put(url, content=tar, headers={"content-digest": good})
    assert accepted.status_code == 201, accepted.text
    assert [p.name for p in directory.iterdir()] == [files_hash]


@pytest.mark.parametrize("settings", [{"reserve_disk_mb": 1 << 40}])
async def test_an_upload_under_the_disk_reserve_is_refused(build_node: BuildNode) -> None:
    (build_node.context / "a.txt").write_text("a\n")
    files_hash, tar = archive(build_node.context, "a.txt", "/srv/")
    ids = await request(build_node, "full")
    template_id = ids[0]
    url = f"/templates/{template_id}/files/{files_hash}"
    declared = await build_node.client.put(url, content=tar)
    streamed = await build_node.client.put(url, content=one_chunk(tar))  # chunked: no length
    for response in (declared, streamed):
        assert response.status_code == 507, response.text
        assert "reserve_disk_mb" in response.json()["message"]
    directory = build_node.builder.files.path(template_id, files_hash).parent
    assert not directory.exists() or list(directory.iterdir()) == []


async def test_unused_uploads_and_deleted_templates_uploads_are_removed(
    build_node: BuildNode,
) -> None:
    (build_node.context / "a.txt").write_text("a\n")
    files_hash, tar = archive(build_node.context, "a.txt", "/srv/")
    copy = {"type": "COPY", "args": ["a.txt", "/srv/"], "filesHash": files_hash}
    paths = {}
    for name in ("old", "used", "deleted"):
        ids = await request(build_node, name)
        url = f"/templates/{ids[0]}/files/{files_hash}"
        assert (await build_node.client.put(url, content=tar)).status_code == 201
        paths[name] = build_node.builder.files.path(ids[0], files_hash)
        if name != "old":
            assert (await build(build_node, ids, [copy]))["status"] == "ready"
    legacy = paths["old"].parent.parent / ("cd" * 32)  # an earlier version's flat upload
    legacy.write_bytes(tar)
    day_ago = time.time() - UNUSED_FOR - 60
    for path in (paths["old"], paths["used"], legacy):
        os.utime(path, (day_ago, day_ago))
    # Found present by the SDK's files query: used again.
    used_url = f"/templates/{paths['used'].parent.name}/files/{files_hash}"
    assert (await build_node.client.get(used_url)).json()["present"] is True
    deleted = await build_node.client.delete(f"/templates/{paths['deleted'].parent.name}")
    assert deleted.status_code == 204
    assert not paths["deleted"].parent.exists()
    await build_node.builder.sweep()
    assert not paths["old"].exists() and not legacy.exists()
    assert paths["used"].is_file()


async def test_uploads_under_way_count_what_they_declared(build_node: BuildNode) -> None:
    """Two uploads that each fit above the reserve, not both: the second is refused while the
    first has written little of what it declared, and accepted once it ended."""
    (build_node.context / "a.txt").write_text("a\n")
    files_hash, tar = archive(build_node.context, "a.txt", "/srv/")
    template_id = (await request(build_node, "both"))[0]
    url = f"/templates/{template_id}/files/{files_hash}"
    files = build_node.builder.files
    free_mb = await asyncio.to_thread(files.reserve.free_disk_mb)
    files.reserve = HostReserve(files.reserve.path, free_mb - 1000, 0)  # 1000 MiB of room
    sent, finish = asyncio.Event(), asyncio.Event()

    async def first_body() -> AsyncIterator[bytes]:
        yield tar
        sent.set()
        await finish.wait()  # then it ends short of what it declared

    first = asyncio.create_task(
        build_node.client.put(url, content=first_body(), headers={"content-length": str(900 << 20)})
    )
    try:
        await sent.wait()
        declared = {"content-length": str(500 << 20)}
        refused = await build_node.client.put(url, content=one_chunk(tar), headers=declared)
        assert refused.status_code == 507, refused.text
    finally:
        finish.set()
        assert (await first).status_code == 201
    accepted = await build_node.client.put(url, content=one_chunk(tar), headers=declared)
    assert accepted.status_code == 201, accepted.text
