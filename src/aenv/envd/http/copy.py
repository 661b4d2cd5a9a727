"""`POST /aenv/copy`: a Dockerfile-style COPY inside the guest, for template builds.

The builder uploads the step's gzip'd tar (through `/files`) and asks envd to place `src` of it
(a path or glob relative to the archive's root) at `dest`: a directory's contents into `dest`, a
file to `dest` (or into it when `dest` ends with `/` or is a directory, or several matched),
owned by `owner` (user and primary group), with `mode` on what was placed if given. envd does it
itself rather than a shell script, so COPY works in images without bash, tar or coreutils
(Alpine, busybox-only, distroless). Not an E2B route: only our builder calls it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tarfile
import tempfile

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aenv.envd.http.files import HTTPFailure, json_error
from aenv.envd.users import UnknownUserError, User


class CopyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    archive: str = Field(min_length=1)  # a gzip'd tar in the guest; removed afterwards
    src: str = Field(min_length=1)
    dest: str = Field(min_length=1)
    owner: str = Field(min_length=1)
    mode: str | None = Field(default=None, pattern=r"^[0-7]{3,4}$")


async def copy(request: Request) -> Response:
    try:
        body = CopyRequest.model_validate_json(await request.body())
    except ValidationError as e:
        return json_error(400, f"invalid copy request: {e.errors(include_url=False)}")
    if not os.path.isabs(body.dest):
        return json_error(400, f"dest must be an absolute path, not {body.dest!r}")
    try:
        owner = User.lookup(body.owner)
    except UnknownUserError as e:
        return json_error(400, str(e))
    try:
        # Blocking file work in a thread: the event loop keeps serving other requests.
        placed = await run_in_threadpool(_copy, body, owner)
    except HTTPFailure as e:
        return json_error(e.status, e.message)
    except tarfile.TarError as e:  # not a gzip'd tar, or a member that would land outside
        return json_error(400, f"COPY {body.src}: bad archive: {e}")
    except OSError as e:
        return json_error(500, f"COPY {body.src} {body.dest}: {e}")
    return JSONResponse({"placed": placed})


def _copy(body: CopyRequest, owner: User) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="aenv-copy-") as tmp:
        try:
            with tarfile.open(body.archive, "r:gz") as tar:
                tar.extractall(tmp, members=_checked(tar.getmembers()))  # noqa: S202
        except (FileNotFoundError, NotADirectoryError) as e:
            raise HTTPFailure(400, f"archive {body.archive} does not exist") from e
        except IsADirectoryError as e:
            raise HTTPFailure(400, f"archive {body.archive} is a directory") from e
        finally:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError, IsADirectoryError):
                os.unlink(body.archive)
        matches = sorted(
            glob.glob(body.src.lstrip("/"), root_dir=tmp, recursive=True, include_hidden=True)
        )
        if not matches:
            raise HTTPFailure(400, f"COPY: nothing matches {body.src}")
        many = len(matches) > 1
        placed = []
        for match in matches:
            item = os.path.join(tmp, match)
            target = _place(item, body.dest, many)
            _chown_tree(target, owner)
            if body.mode is not None and not os.path.islink(target):  # a link has no mode
                os.chmod(target, int(body.mode, 8))
            placed.append(target)
        return placed


def _checked(members: list[tarfile.TarInfo]) -> list[tarfile.TarInfo]:
    """Only files, directories and links, without setuid bits, none landing outside the
    extraction root. A symbolic link may point anywhere (the SDKs archive a link as a link, and
    one to an absolute or missing path is placed as it is), but no member may pass through one,
    or be one again: extracting it would write where the link points. (tarfile's
    `filter="data"` refuses such links outright, and exists from Python 3.11.4 only.)"""
    links: set[str] = set()
    for member in members:
        name = os.path.normpath(member.name)
        if os.path.isabs(member.name) or name == ".." or name.startswith("../"):
            raise tarfile.TarError(f"member {member.name!r} would land outside the archive")
        if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
            raise tarfile.TarError(f"member {member.name!r} is not a file, directory or link")
        paths = [name]
        if member.islnk():
            # A hard link names a member from the root: it must be one inside.
            target = os.path.normpath(member.linkname)
            if os.path.isabs(member.linkname) or target == ".." or target.startswith("../"):
                raise tarfile.TarError(f"link {member.name!r} points outside the archive")
            paths.append(target)
        for path in paths:
            parts = path.split("/")
            if any("/".join(parts[:i]) in links for i in range(1, len(parts) + 1)):
                raise tarfile.TarError(f"member {member.name!r} passes through a symbolic link")
        if member.issym():
            links.add(name)
        member.mode &= 0o777
    return members


def _place(item: str, dest: str, many: bool) -> str:
    if os.path.isdir(item) and not os.path.islink(item):
        os.makedirs(dest, exist_ok=True)
        shutil.copytree(item, dest, symlinks=True, dirs_exist_ok=True)
        return dest
    if many or dest.endswith("/") or os.path.isdir(dest):
        os.makedirs(dest, exist_ok=True)
        target = os.path.join(dest, os.path.basename(item))
    else:
        os.makedirs(os.path.dirname(dest) or "/", exist_ok=True)
        target = dest
    if os.path.lexists(target) and not os.path.isdir(target):
        os.unlink(target)  # a symlink there would otherwise be followed
    shutil.copy2(item, target, follow_symlinks=False)
    return target


def _chown_tree(target: str, owner: User) -> None:
    os.chown(target, owner.uid, owner.gid, follow_symlinks=False)
    if os.path.isdir(target) and not os.path.islink(target):
        for root, dirs, files in os.walk(target):
            for name in dirs + files:
                os.chown(os.path.join(root, name), owner.uid, owner.gid, follow_symlinks=False)
