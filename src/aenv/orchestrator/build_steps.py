"""How template build steps act on a build VM: through its envd, as any client would.

Commands (RUN, the start and ready commands) go over envd's process RPC (Connect, the generated
stubs in `aenv.envd.proto`) as the step's user; COPY writes the uploaded archive into the guest
and has envd place its files (`EnvdClient.write_file` and `copy`), which works in any image.
ENV, WORKDIR and USER only change `BuildState`, which every later command gets and the finished
template records for its sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import posixpath
import stat
import tarfile
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pyqwest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from aenv.envd.proto.filesystem import filesystem_pb as fs
from aenv.envd.proto.filesystem.filesystem_connect import FilesystemClient
from aenv.envd.proto.process import process_pb as pb
from aenv.envd.proto.process.process_connect import ProcessClient
from aenv.orchestrator.envd_client import EnvdClient, EnvdRefused, EnvdUnavailable, rpc_transport

OutputSink = Callable[[str], None]
_NO_ENV: Mapping[str, str] = {}
MAX_LINE = 1 << 16  # bytes of a command's output line; a longer one is cut into several


class StepType(enum.StrEnum):
    """The template build steps E2B's SDKs send (Dockerfile instructions)."""

    RUN = "RUN"
    COPY = "COPY"
    ENV = "ENV"
    WORKDIR = "WORKDIR"
    USER = "USER"


class StepFailed(RuntimeError):
    """A step did not do what it says (non-zero exit, bad arguments, unverifiable files)."""


@dataclass
class BuildState:
    """What ENV, WORKDIR and USER steps have set so far."""

    user: str = "user"
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)


class GuestShell:
    """Runs commands and writes files in one build VM through its envd."""

    def __init__(self, envd: EnvdClient) -> None:
        self.envd = envd
        # A connection pool of its own, closed with the shell: the process-wide default one
        # would keep connections to this VM's address, which a later VM may be given.
        self._transport = rpc_transport()
        http = pyqwest.Client(self._transport)
        self._rpc = ProcessClient(envd.url, http_client=http)
        self._fs = FilesystemClient(envd.url, http_client=http)

    async def close(self) -> None:
        await self._rpc.close()
        await self._fs.close()
        await self._transport.aclose()

    def _headers(self, user: str) -> dict[str, str]:
        return self.envd.headers(user)

    def _start(
        self, command: str, user: str, state: BuildState, extra_env: Mapping[str, str]
    ) -> AsyncIterator[pb.StartResponse]:
        # bash as the SDKs run commands; images without it get their sh.
        login = 'command -v bash >/dev/null 2>&1 && exec bash -l -c "$1"; exec sh -l -c "$1"'
        envs = {**extra_env, **state.env}
        config = pb.ProcessConfig(cmd="/bin/sh", args=["-c", login, "sh", command], envs=envs)
        if state.workdir:
            config.cwd = state.workdir
        request = pb.StartRequest(process=config, stdin=False)
        stream: AsyncIterator[pb.StartResponse] = self._rpc.start(
            request, headers=self._headers(user)
        )
        return stream

    async def run(
        self,
        command: str,
        user: str,
        state: BuildState,
        output: OutputSink | None = None,
        extra_env: Mapping[str, str] = _NO_ENV,
    ) -> int:
        """Run `command` with bash as `user` to its end; its output lines go to `output`.
        `extra_env` is for this command only, under the state's env."""
        return await _follow(self._start(command, user, state, extra_env), output)

    def start(
        self, command: str, user: str, state: BuildState, output: OutputSink
    ) -> asyncio.Task[int]:
        """Start a long-running `command`; the task follows its output until it ends or is
        cancelled (the process keeps running when the stream is dropped)."""
        return asyncio.create_task(_follow(self._start(command, user, state, _NO_ENV), output))

    async def warm_up(self, user: str) -> None:
        """Do once what a sandbox's first SDK calls do (a login shell through the process
        service, a file read), so that a template saved right after holds a guest that has:
        bash and its libraries in the page cache, envd's code paths run. Otherwise every
        sandbox of the template pays for that on its first command (≈ 100 ms under TCG)."""
        if await self.run("true", user, BuildState(user=user)) != 0:
            raise StepFailed("the warm-up command failed")
        try:
            await self.envd.read_file("/etc/hostname", user)
        except EnvdUnavailable as e:
            raise StepFailed(f"the warm-up read failed: {_why(e)}") from e

    async def make_dir(self, path: str, user: str) -> None:
        """`mkdir -p` through envd itself (an image may have no mkdir)."""
        try:
            await self._fs.make_dir(fs.MakeDirRequest(path=path), headers=self._headers(user))
        except ConnectError as e:
            if e.code != Code.ALREADY_EXISTS:
                raise StepFailed(f"cannot create {path}: {e}") from e

    async def copy(
        self, archive: str, src: str, dest: str, owner: str, mode: str | None
    ) -> list[str]:
        """COPY: envd places `src` of the uploaded `archive` at `dest` (envd's `/aenv/copy`,
        which needs nothing of the image: no shell, tar or coreutils). Returns what it placed."""
        try:
            return await self.envd.copy(archive, src, dest, owner, mode)
        except EnvdUnavailable as e:
            raise StepFailed(f"COPY {src} {dest}: {_why(e)}") from e

    async def write(self, path: str, data: bytes | Path) -> None:
        """Write `data`, or the file at that host path, to `path` in the VM; a file is sent as
        it is read, never held whole in memory."""
        try:
            await self.envd.write_file(path, data)
        except EnvdUnavailable as e:
            raise StepFailed(f"writing {path} into the VM: {_why(e)}") from e


def _why(e: EnvdUnavailable) -> str:
    """What a build's log says of envd's failure: its own reason when it refused."""
    return e.reason if isinstance(e, EnvdRefused) else str(e)


async def warm_up(envd: EnvdClient, user: str) -> None:
    """`GuestShell.warm_up` in a guest that has no shell open yet (a template just booted, a
    pooled VM just restored)."""
    shell = GuestShell(envd)
    try:
        await shell.warm_up(user)
    finally:
        await shell.close()


async def _follow(stream: AsyncIterator[pb.StartResponse], output: OutputSink | None) -> int:
    pending = {"stdout": b"", "stderr": b""}

    def emit(kind: str, data: bytes, final: bool = False) -> None:
        pending[kind] += data
        *lines, pending[kind] = pending[kind].split(b"\n")
        # Output without a newline is cut into lines too: held whole, it would grow unbounded.
        while len(pending[kind]) > MAX_LINE:
            lines.append(pending[kind][:MAX_LINE])
            pending[kind] = pending[kind][MAX_LINE:]
        if final and pending[kind]:
            lines.append(pending[kind])
        if output is not None:
            for line in lines:
                output(line.decode(errors="replace"))

    exit_code = -1
    async for response in stream:
        event = response.event.event if response.event is not None else None
        match event:
            case Oneof(
                field="data", value=pb.ProcessEvent.DataEvent(output=Oneof(field=kind, value=data))
            ):
                if kind in pending:
                    emit(kind, data)
            case Oneof(field="end", value=end):
                exit_code = end.exit_code
    for kind in pending:
        emit(kind, b"", final=True)
    return exit_code


class BadArchive(ValueError):
    """A COPY archive holds a member the step cannot take; nothing of it was placed."""


def tar_files_hash(archive: Path, src: str, dest: str) -> str:
    """The hash the E2B SDK computes for `COPY src dest` (`calculate_files_hash`: the step,
    then each file's relative path, mode, size and content in archive order), rebuilt from the
    archive the SDK uploaded, whose members are those files in that order. `BadArchive` for a
    hard link to no regular file before it (the SDK archives a second name of a file as a hard
    link to the first, and hashes it as that file). The archive is read from its file a chunk
    at a time (a hard link's content by seeking back). Blocking: run it in a thread."""
    digest = hashlib.sha256(f"COPY {src} {dest}".encode())
    files: dict[str, tarfile.TarInfo] = {}  # regular files so far, by name, as tarfile finds them
    with tarfile.open(archive, mode="r:*") as tar:
        for member in tar:
            digest.update(member.name.encode())
            if member.issym():
                digest.update(str(stat.S_IFLNK | member.mode).encode())
                digest.update(str(len(member.linkname.encode())).encode())
                digest.update(member.linkname.encode())
                continue
            if member.isdir():
                digest.update(str(stat.S_IFDIR | member.mode).encode())
                continue
            content = member
            if member.islnk():
                found = files.get(posixpath.normpath(member.linkname))
                if found is None:
                    raise BadArchive(
                        f"{member.name} is a hard link to {member.linkname}, which is not a "
                        "file of the archive before it"
                    )
                content = found
            files[posixpath.normpath(member.name)] = content
            digest.update(str(stat.S_IFREG | member.mode).encode())
            digest.update(str(content.size).encode())
            extracted = tar.extractfile(content)
            if extracted is not None:
                with contextlib.closing(extracted):
                    while chunk := extracted.read(1 << 20):
                        digest.update(chunk)
    return digest.hexdigest()
