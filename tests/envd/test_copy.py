"""envd's `/aenv/copy` (template builds' COPY): Dockerfile placement rules, ownership, mode,
and bad input, against envd in its throwaway root."""

from __future__ import annotations

import io
import tarfile
import uuid
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv.orchestrator.build_steps import GuestShell
from aenv.orchestrator.envd_client import EnvdClient


def _archive(files: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        # Links first: a file after one may try to pass through it.
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _copy(
    sandbox: Sandbox, envd_url: str, archive: bytes, src: str, dest: str, **extra: str
) -> httpx.Response:
    staged = f"/tmp/copy-{uuid.uuid4().hex[:8]}.tar.gz"
    sandbox.files.write(staged, archive, user="root")
    body = {"archive": staged, "src": src, "dest": dest, "owner": "user", **extra}
    return httpx.post(f"{envd_url}/aenv/copy", json=body, timeout=30)


def _ls(sandbox: Sandbox, path: str) -> str:
    return sandbox.commands.run(f"cd {path} && find . | sort", user="root").stdout


APP = {"app/a.txt": b"a", "app/sub/b.txt": b"b", "app/.hidden": b"h", "top.txt": b"t"}


async def test_a_builds_archive_goes_from_the_hosts_disk_to_its_place(
    sandbox: Sandbox, envd_url: str, workdir: str, tmp_path: Path
) -> None:
    """As a build's COPY sends it: the upload's file, read as it is sent, never held whole."""
    archive = tmp_path / "upload.tar.gz"
    archive.write_bytes(_archive(APP))
    staged = f"/tmp/copy-{uuid.uuid4().hex[:8]}.tar.gz"
    async with httpx.AsyncClient() as http:
        shell = GuestShell(EnvdClient(http, "127.0.0.1"))
        try:
            await shell.write(staged, archive)
            placed = await shell.copy(staged, "app", f"{workdir}/dest", "user", None)
        finally:
            await shell.close()
    assert placed == [f"{workdir}/dest"]
    assert sandbox.files.read(f"{workdir}/dest/sub/b.txt") == "b"


def test_a_directory_goes_into_dest_owned_by_the_owner(
    sandbox: Sandbox, envd_url: str, workdir: str
) -> None:
    response = _copy(sandbox, envd_url, _archive(APP), "app", f"{workdir}/dest")
    assert response.status_code == 200, response.text
    assert response.json() == {"placed": [f"{workdir}/dest"]}
    assert _ls(sandbox, f"{workdir}/dest").split() == [
        ".",
        "./.hidden",
        "./a.txt",
        "./sub",
        "./sub/b.txt",
    ]
    owners = sandbox.commands.run(f"stat -c %U {workdir}/dest/sub/b.txt {workdir}/dest").stdout
    assert owners.split() == ["user", "user"]


def test_a_file_to_a_path_into_a_directory_and_with_a_mode(
    sandbox: Sandbox, envd_url: str, workdir: str
) -> None:
    assert _copy(sandbox, envd_url, _archive(APP), "top.txt", f"{workdir}/x/renamed").is_success
    assert sandbox.files.read(f"{workdir}/x/renamed") == "t"
    response = _copy(sandbox, envd_url, _archive(APP), "top.txt", f"{workdir}/into/", mode="0750")
    assert response.json() == {"placed": [f"{workdir}/into/top.txt"]}
    stat = sandbox.commands.run(f"stat -c '%U %a' {workdir}/into/top.txt").stdout
    assert stat == "user 750\n"


def test_a_glob_places_each_match(sandbox: Sandbox, envd_url: str, workdir: str) -> None:
    response = _copy(sandbox, envd_url, _archive(APP), "app/**/*.txt", f"{workdir}/g")
    assert response.json()["placed"] == [f"{workdir}/g/a.txt", f"{workdir}/g/b.txt"]
    # The archive is removed once used.
    assert sandbox.commands.run("ls /tmp/copy-*.tar.gz 2>/dev/null || true").stdout == ""


def test_links_are_placed_as_links_wherever_they_point(
    sandbox: Sandbox, envd_url: str, workdir: str
) -> None:
    # As the SDK archives E2B's own test folder: links relative, absolute (a path of the
    # machine that built the archive) and to nothing.
    links = {
        "folder/relative.txt": "test.txt",
        "folder/absolute.txt": "/tmp/elsewhere/test.txt",
        "folder/dangling.txt": "12345test.txt",
    }
    archive = _archive({"folder/test.txt": b"t"}, links=links)
    response = _copy(sandbox, envd_url, archive, "folder/*", f"{workdir}/f", mode="0640")
    assert response.status_code == 200, response.text
    targets = sandbox.commands.run(f"cd {workdir}/f && readlink *.txt; cat test.txt").stdout
    assert targets.split() == ["/tmp/elsewhere/test.txt", "12345test.txt", "test.txt", "t"]


@pytest.mark.parametrize(
    ("archive", "src", "extra", "message"),
    [
        (_archive(APP), "nope", {}, "nothing matches"),
        (_archive({"../evil.txt": b"x"}), "*", {}, "bad archive"),
        (_archive({"out/evil": b"x"}, links={"out": "/tmp"}), "*", {}, "symbolic link"),
        (_archive({"out": b"x"}, links={"out": "/tmp/evil"}), "*", {}, "symbolic link"),
        (b"not a tar", "x", {}, "bad archive"),
        (_archive(APP), "app", {"owner": "nobody-here"}, "nobody-here"),
        (_archive(APP), "app", {"mode": "999"}, "invalid copy request"),
    ],
)
def test_bad_input_is_a_400_and_changes_nothing(
    sandbox: Sandbox,
    envd_url: str,
    workdir: str,
    archive: bytes,
    src: str,
    extra: dict[str, str],
    message: str,
) -> None:
    response = _copy(sandbox, envd_url, archive, src, f"{workdir}/bad", **extra)
    assert response.status_code == 400, response.text
    assert message in response.json()["message"]
    assert not sandbox.files.exists(f"{workdir}/bad")


def test_dest_must_be_absolute(sandbox: Sandbox, envd_url: str) -> None:
    response = _copy(sandbox, envd_url, _archive(APP), "app", "relative/dir")
    assert response.status_code == 400
    assert "absolute" in response.json()["message"]


@pytest.mark.parametrize("kind", ["under-a-file", "a-directory"])
def test_an_archive_path_that_is_no_file_is_a_400(
    sandbox: Sandbox, envd_url: str, workdir: str, kind: str
) -> None:
    # Found by the fuzzer: a path through a regular file answered 500 ("Not a directory").
    sandbox.files.write(f"{workdir}/plain", "x")
    archive = f"{workdir}/plain/x.tar.gz" if kind == "under-a-file" else workdir
    body = {"archive": archive, "src": "a", "dest": f"{workdir}/dest", "owner": "user"}
    response = httpx.post(f"{envd_url}/aenv/copy", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert sandbox.files.exists(workdir)
