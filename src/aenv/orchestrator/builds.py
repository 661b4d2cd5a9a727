"""Template builds: a VM started from a base template, steps applied inside it through envd,
the start command left running, the VM saved as the template's new build.

The build VM is an ordinary but internal sandbox (metadata `aenv.build`; not listed to users,
killed rather than paused at shutdown), so building reuses restore, save and cleanup. Its
network reaches the package registries and nothing else (`build_egress`). After each
RUN or COPY step its state is saved as a hidden build-layer template keyed by (parent key, step,
files hash): a later build whose first steps match starts from the newest such layer instead of
re-running them. A build's log goes to disk as it comes, bounded, and is read a page at a time
(`build_logs`: the E2B status route, `aenv template logs`); each build's record (status,
reason) is written to `$AENV_HOME/builds/` when it starts and ends, so it outlives a restart.
Both go with the build's template, or when the build is among the oldest past `MAX_BUILDS`. With a
snapshot repository, a finished build is uploaded there before it is ready, so in a cluster
every node can start sandboxes from it once it is (`aenv.cluster.saved`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shlex
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
from connectrpc.errors import ConnectError

from aenv import atomic
from aenv.config import Paths
from aenv.ids import TEAM_ID, new_build_id, new_sandbox_id
from aenv.network.settings import SandboxNetwork
from aenv.oci import ImageError, rootfs_from_image
from aenv.orchestrator import build_records
from aenv.orchestrator.build_egress import GUEST_CA, GUEST_CA_DIR, BuildEgress
from aenv.orchestrator.build_files import BuildFiles
from aenv.orchestrator.build_logs import BuildLog
from aenv.orchestrator.build_records import (
    RUNNING,
    Build,
    BuildError,
    BuildSpec,
    BuildStatus,
    Step,
)
from aenv.orchestrator.build_steps import (
    BadArchive,
    BuildState,
    GuestShell,
    StepFailed,
    StepType,
    tar_files_hash,
)
from aenv.orchestrator.kinds import TemplateKind
from aenv.orchestrator.lifecycle import CreateRequest, Orchestrator
from aenv.orchestrator.reserve import HostReserve
from aenv.orchestrator.tags import TagStore
from aenv.orchestrator.templates import Template, TemplateNotFound

log = logging.getLogger("aenv.builds")
CANCELLED = "cancelled by the node's operator"

# The build VM's sandbox timeout: a bound on the whole build.
BUILD_VM_TIMEOUT = 3600
READY_POLL_SECONDS = 0.5
MAX_BUILDS = 1000  # builds (with their logs) remembered
FILES_HASH = re.compile(r"^[0-9a-f]{64}$")


def split_name(name: str) -> tuple[str, str | None]:
    """`name:tag` → (name, tag)."""
    base, _, tag = name.partition(":")
    return base, tag or None


# Cold-boots an image's root filesystem (an ext4 file) into a hidden base template, once per
# (image digest, guest images); the server provides it, since it owns the guest images.
ImageBooter = Callable[[Path, str], Awaitable[Template]]


class Builder:
    def __init__(
        self,
        orchestrator: Orchestrator,
        tags: TagStore,
        paths: Paths,
        ready_timeout: float,
        boot_image: ImageBooter | None = None,
        *,
        cache_layers: int = 32,
        egress: BuildEgress | None = None,
    ) -> None:
        self.orc = orchestrator
        self.tags = tags
        config = orchestrator.config
        self.files = BuildFiles(
            paths.build_files,
            HostReserve(config.home, config.reserve_disk_mb, config.reserve_memory_mb),
        )
        self.records_dir = paths.builds  # per build: its record (JSON) and its log (SQLite)
        self.log_max_bytes = config.build_log_max_mb << 20
        self.oci_cache = paths.oci_cache
        self.rootfs_dir = paths.oci_rootfs
        self.ready_timeout = ready_timeout
        self.boot_image = boot_image
        self.cache_layers = cache_layers
        # None: build VMs get a sandbox's default network.
        self.egress = egress
        self._builds: dict[str, Build] = {}  # by build id, oldest first
        # Held: running builds are not collected; by build id, for a cancel.
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelled: set[str] = set()  # builds the operator cancelled
        self._image_locks: dict[str, asyncio.Lock] = {}
        self._reserved: dict[str, Build] = {}  # by name: see `reserve`
        self._load_records()
        orchestrator.chores.append(self.sweep)
        orchestrator.template_deleted.append(self.forget)

    def _load_records(self) -> None:
        """The builds recorded; a record of an earlier version, its log inline, has the log
        moved to its own file (capped) and is written again without it."""
        self.records_dir.mkdir(parents=True, exist_ok=True)
        builds = []
        for path in self.records_dir.glob("*.json"):
            try:
                build, inline = build_records.from_json(path.read_text())
            except (OSError, ValueError, TypeError, KeyError):
                log.warning("unreadable build record %s", path)
                continue
            build.journal = self._journal(build.build_id)
            if inline is not None:
                build.journal.delete()  # a crash between the moves left a partial copy
                build.journal.extend(inline)
                build.journal.close()
                self._record(build)
            builds.append(build)
        builds.sort(key=lambda b: b.created_at)
        for old in builds[:-MAX_BUILDS]:
            self._remove_record(old)
        for build in builds[-MAX_BUILDS:]:
            self._builds[build.build_id] = build

    def _journal(self, build_id: str) -> BuildLog:
        return BuildLog(self.records_dir / f"{build_id}.log.db", self.log_max_bytes)

    def _record(self, build: Build) -> None:
        atomic.write_text(self.records_dir / f"{build.build_id}.json", build_records.to_json(build))

    def _remove_record(self, build: Build) -> None:
        (self.records_dir / f"{build.build_id}.json").unlink(missing_ok=True)
        build.logs.delete()

    def request(
        self,
        name: str,
        tags: list[str],
        cpu_count: int | None = None,
        memory_mb: int | None = None,
        team_id: str = TEAM_ID,
    ) -> Build:
        """A new build, waiting for its steps, of the template called `name` (`name:tag`; an
        existing template gets a new build under its id), tagged `tags` once ready; its
        sandboxes get `cpu_count` vCPUs and `memory_mb` of memory (default: the base's); the
        template is `team_id`'s (a name another team uses, or a public template's, makes a
        template of its own: names are unique within a team)."""
        alias, tag = split_name(name)
        named = tuple(dict.fromkeys([*tags, tag] if tag else tags or ["latest"]))
        reserved = self._reserved.pop(alias, None)
        if reserved is not None and reserved.status is BuildStatus.WAITING:
            reserved.tags = named
            reserved.cpu_count, reserved.memory_mb = cpu_count, memory_mb
            self._record(reserved)
            return reserved
        template_id = next(
            (
                b.template_id
                for b in self._builds.values()
                if b.name == alias and b.team_id == team_id
            ),
            None,
        )
        with contextlib.suppress(TemplateNotFound):
            existing = self.orc.templates.get(alias, team_id)
            if existing.team_id == team_id:
                template_id = existing.template_id
        build = Build(
            template_id=template_id or new_sandbox_id(),
            build_id=new_build_id(),
            name=alias,
            tags=named,
            created_at=time.time(),
            cpu_count=cpu_count,
            memory_mb=memory_mb,
            team_id=team_id,
        )
        build.journal = self._journal(build.build_id)
        self._builds[build.build_id] = build
        # Bounded: the oldest builds not running are forgotten (their logs with them).
        idle = [b for b in self._builds.values() if b.status is not BuildStatus.BUILDING]
        for old in idle[: max(0, len(self._builds) - MAX_BUILDS)]:
            del self._builds[old.build_id]
            self._remove_record(old)
        self._record(build)
        return build

    def reserve(self, name: str) -> Build:
        """A waiting build of `name` that the next `request` for it takes over: the node
        announces a build it is about to ask its own API for, so that a create in between
        hears "has no ready build" rather than "not found". `abandon` ends it if that request
        never comes."""
        build = self.request(name, [])
        self._reserved[build.name] = build
        return build

    def abandon(self, build: Build, reason: str) -> None:
        """End a reserved build that no request took over, in `error` with `reason`."""
        if self._reserved.get(build.name) is not build:
            return
        del self._reserved[build.name]
        build.reason = BuildError(reason)
        build.log(f"Build failed: {reason}", level="error")
        build.status = BuildStatus.ERROR
        build.logs.close()
        self._record(build)

    def get(self, template_id: str, build_id: str) -> Build | None:
        build = self._builds.get(build_id)
        if build is None or template_id not in (build.template_id, build.name):
            return None
        return build

    def unfinished(self, name: str) -> Build | None:
        """The build still waiting or running of the template called `name` (id or alias), if
        any: its sandboxes cannot start yet."""
        alias = split_name(name)[0]
        found = [b for b in self.builds_of(alias) if b.status in RUNNING]
        return found[-1] if found else None

    def unfinished_templates(self) -> set[str]:
        """The ids of the templates with a build waiting or running here: a cluster node
        publishes them, so the gateways find these builds again after a Redis wipe."""
        return {b.template_id for b in self._builds.values() if b.status in RUNNING}

    def builds_of(self, template_id: str) -> list[Build]:
        return [b for b in self._builds.values() if template_id in (b.template_id, b.name)]

    def latest(self) -> dict[str, Build]:
        """Each template's newest build, by template id: what its listing shows as its state
        (a template building or failed for the first time has nothing else to show)."""
        newest: dict[str, Build] = {}
        for build in self._builds.values():  # oldest first
            newest[build.template_id] = build
        return newest

    async def forget(self, template_id: str) -> None:
        """What this builder keeps of a deleted template: its builds' records and logs, and
        its uploads; nothing while a build of it is under way (it may copy them, and its end
        makes the template again)."""
        if template_id in self.unfinished_templates():
            return
        for build in self.builds_of(template_id):
            del self._builds[build.build_id]
            build.logs.close()
            await asyncio.to_thread(self._remove_record, build)
        await asyncio.to_thread(self.files.remove_template, template_id)

    async def sweep(self) -> None:
        """Housekeeping: uploads unused for a day, and those of deleted templates."""
        templates = await asyncio.to_thread(self.orc.templates.list_all)
        deleted = {t.template_id for t in templates if t.deleted}
        await asyncio.to_thread(self.files.sweep, deleted - self.unfinished_templates())

    def start(self, build: Build, spec: BuildSpec) -> None:
        build.status = BuildStatus.BUILDING
        self._record(build)
        task = self._tasks[build.build_id] = asyncio.create_task(self._run(build, spec))
        task.add_done_callback(lambda _: self._tasks.pop(build.build_id, None))

    async def cancel_team(self, team_id: str) -> tuple[int, int]:
        """End every waiting or running build of `team_id` in `error` (a running one's VM is
        killed as a failed build's is). Returns how many ended, and how many did not."""
        found = [b for b in self._builds.values() if b.team_id == team_id and b.status in RUNNING]
        return await self._cancel(found)

    async def cancel_template(self, template: str, team_id: str) -> set[str]:
        """End the waiting or running builds of `template` (an id or name) that `team_id`
        requested, as deleting the template does (a build left running would make it again).
        Returns the ids of the templates with builds of that id or name, finished or not."""
        found = [b for b in self.builds_of(template) if b.team_id == team_id]
        await self._cancel([b for b in found if b.status in RUNNING])
        return {b.template_id for b in found}

    async def _cancel(self, found: list[Build]) -> tuple[int, int]:
        for build in found:
            if (task := self._tasks.get(build.build_id)) is not None:
                self._cancelled.add(build.build_id)
                task.cancel()
                await asyncio.wait([task])
            else:  # waiting for its steps: nothing runs yet
                self._reserved.pop(build.name, None)
                build.reason = BuildError(CANCELLED)
                await self._end(build, BuildStatus.ERROR)
        failed = sum(b.status is not BuildStatus.ERROR for b in found)
        return len(found) - failed, failed

    async def _run(self, build: Build, spec: BuildSpec) -> None:
        started = time.monotonic()
        try:
            template = await self._build(build, spec)
        except BuildError as e:
            reason = e
        except asyncio.CancelledError:
            if build.build_id not in self._cancelled:
                raise  # the server stops: the record says so at the next start
            reason = BuildError(CANCELLED)
        except Exception as e:  # whatever broke, the build ends in `error`
            log.exception("build %s failed", build.build_id)
            reason = BuildError(f"{type(e).__name__}: {e}")
        else:
            await self._trim_cache()
            build.log(f"Template {template.template_id} ready ({time.monotonic() - started:.1f} s)")
            self.tags.assign(template.template_id, list(build.tags), build.build_id)
            await self._end(build, BuildStatus.READY)
            return
        build.reason = reason
        build.log(f"Build failed: {reason}", level="error", step=reason.step)
        await self._end(build, BuildStatus.ERROR)

    async def _end(self, build: Build, status: BuildStatus) -> None:
        """Record the build's end, then show it: whoever sees it ended (a client polling, a
        builder started after a restart) finds its record complete."""
        build.logs.close()
        await asyncio.to_thread(self._record, dataclasses.replace(build, status=status))
        build.status = status

    async def _build(self, build: Build, spec: BuildSpec) -> Template:
        base = await self._image_base(spec, build) if spec.from_image else self._base(spec, build)
        size = (build.cpu_count or base.cpu_count, build.memory_mb or base.memory_mb)
        keys = _step_keys(base, spec, size, build.team_id)
        first, source = self._cached_prefix(spec, base, keys)
        total = len(spec.steps)
        for index in range(first):
            build.log(
                f"[{index + 1}/{total}] CACHED {_describe(spec.steps[index])}", step=str(index + 1)
            )
        resized = size != (source.cpu_count, source.memory_mb)
        how = f", booted with {size[0]} vCPU, {size[1]} MiB" if resized else ""
        build.log(f"Starting the build VM from {source.template_id}{how}")
        network = SandboxNetwork() if self.egress is None else self.egress.network()
        record, _ = await self.orc.create(
            CreateRequest(
                template=source.template_id,
                timeout=BUILD_VM_TIMEOUT,
                metadata={"aenv.build": build.build_id},
                env_vars={},
                internal=True,
                size=size if resized else None,
                network=network,
                # What it saves is the build's team's template.
                team_id=build.team_id,
            )
        )
        shell = GuestShell(self.orc.envd(record.id))
        state = BuildState(
            user=source.default_user or "user",
            workdir=source.default_workdir,
            env=dict(source.env_vars),
        )
        try:
            step_env = await self._carry_in_ca(shell)
            if state.workdir:
                # An image's WorkingDir need not exist (Docker creates it at start too).
                await shell.make_dir(state.workdir, "root")
            for index in range(first, total):
                step, label = spec.steps[index], str(index + 1)
                build.log(f"[{label}/{total}] {_describe(step)}", step=label)
                try:
                    await self._apply(shell, state, step, build, label, step_env)
                except StepFailed as e:
                    raise BuildError(str(e), label) from e
                if step.type in (StepType.RUN, StepType.COPY):
                    layer = await self.orc.save_template(
                        record.id, _layer_id(keys[index]), TemplateKind.BUILD_LAYER, ()
                    )
                    await asyncio.to_thread(self.orc.templates.save, _with_state(layer, state))
            if step_env:
                await shell.run(f"rm -rf {GUEST_CA_DIR}", "root", BuildState(user="root"))
            if spec.start_cmd:
                await self._start_service(shell, state, spec, build)
            await shell.warm_up(state.user)
            saved = await self.orc.save_template(
                record.id, build.template_id, TemplateKind.TEMPLATE, (build.name,)
            )
        finally:
            await shell.close()
            await self.orc.kill(record.id)
        template = dataclasses.replace(
            _with_state(saved, state), build_id=build.build_id, team_id=build.team_id
        )
        await asyncio.to_thread(self.orc.templates.save, template)
        # Ready means usable: in a cluster, by every node (the copy is what they pull).
        await self.orc.saved.push_template(template)
        stored = await asyncio.to_thread(self.orc.templates.by_id, template.template_id)
        if stored is not None and stored.manifest_id is not None:
            build.log(f"Stored in the snapshot repository as {stored.manifest_id}")
            return stored
        return template

    async def _image_base(self, spec: BuildSpec, build: Build) -> Template:
        """The hidden template an image boots into: pulled, unpacked and cold-booted once per
        image digest; the image's Env and WorkingDir start the build's state."""
        assert spec.from_image is not None
        if self.boot_image is None:
            raise BuildError("this node cannot build from images")
        build.log(f"Pulling {spec.from_image}", step="base")
        await asyncio.to_thread(self.rootfs_dir.mkdir, parents=True, exist_ok=True)
        partial = self.rootfs_dir / f".pull-{uuid.uuid4()}.ext4"
        try:
            rootfs = await rootfs_from_image(
                spec.from_image, partial, cache=self.oci_cache, credentials=spec.credentials
            )
            image = self.rootfs_dir / f"{rootfs.digest.replace(':', '-')}.ext4"
            lock = self._image_locks.setdefault(image.name, asyncio.Lock())
            async with lock:
                # Same digest, same bytes: a template already booted from `image` keeps its file.
                if not await asyncio.to_thread(image.exists):
                    await asyncio.to_thread(os.replace, partial, image)
                build.log(f"Image {rootfs.reference}@{rootfs.digest}", step="base")
                base = await self.boot_image(image, rootfs.digest)
        except (ImageError, httpx.HTTPError) as e:
            raise BuildError(f"image {spec.from_image}: {e}", "base") from e
        finally:
            await asyncio.to_thread(partial.unlink, True)
        config = rootfs.config
        state = BuildState(workdir=config.working_dir, env=config.env_dict())
        if (base.env_vars, base.default_workdir) != (state.env, state.workdir):
            base = _with_state(base, state)
            await asyncio.to_thread(self.orc.templates.save, base)
        return base

    async def _trim_cache(self) -> None:
        """Drop cached step layers beyond the newest `cache_layers` (by when they were saved or
        last reused); their files go once no sandbox depends on them."""
        layers = [
            t
            for t in self.orc.templates.list_all()
            if t.kind is TemplateKind.BUILD_LAYER and not t.deleted
        ]
        layers.sort(key=lambda t: t.created_at, reverse=True)
        for old in layers[self.cache_layers :]:
            await asyncio.to_thread(self.orc.templates.hide, old.template_id)
        if len(layers) > self.cache_layers:
            await self.orc.saved.collect()

    def _base(self, spec: BuildSpec, build: Build) -> Template:
        """The template the build starts from: one its team may see."""
        name = spec.from_template or "base"
        try:
            return self.orc.templates.get(name, build.team_id)
        except TemplateNotFound as e:
            raise BuildError(f"base template '{name}' not found") from e

    def _cached_prefix(
        self, spec: BuildSpec, base: Template, keys: list[str]
    ) -> tuple[int, Template]:
        """How many leading steps a stored layer already has applied, and where to start."""
        if spec.force:
            return 0, base
        limit = next((i for i, s in enumerate(spec.steps) if s.force), len(spec.steps))
        for index in reversed(range(limit)):
            layer = self.orc.templates.by_id(_layer_id(keys[index]))
            if layer is not None and layer.kind is TemplateKind.BUILD_LAYER and not layer.deleted:
                # Reused: the cache keeps the most recently used layers.
                self.orc.templates.save(dataclasses.replace(layer, created_at=time.time()))
                return index + 1, layer
        return 0, base

    async def _carry_in_ca(self, shell: GuestShell) -> dict[str, str]:
        """Write the host's CA bundle into the build VM; the env vars RUN steps then get."""
        if self.egress is None or self.egress.ca_bundle is None:
            return {}
        try:
            bundle = await asyncio.to_thread(self.egress.ca_bundle.read_bytes)
        except OSError as e:
            raise BuildError(f"build_ca_bundle {self.egress.ca_bundle}: {e.strerror}") from e
        await shell.write(GUEST_CA, bundle)
        return self.egress.step_env()

    async def _apply(
        self,
        shell: GuestShell,
        state: BuildState,
        step: Step,
        build: Build,
        label: str,
        step_env: dict[str, str],
    ) -> None:
        args = step.args
        match step.type, len(args):
            case StepType.RUN, 1 | 2:
                user = args[1] if len(args) == 2 and args[1] else state.user
                code = await shell.run(
                    args[0], user, state, lambda line: build.log(line, step=label), step_env
                )
                if code != 0:
                    raise StepFailed(f"RUN {args[0]!r} exited with code {code}")
            case StepType.COPY, 2 | 3 | 4:
                await self._copy(shell, state, step, build, label)
            case StepType.ENV, n if n % 2 == 0 and n > 0:
                state.env.update(zip(args[::2], args[1::2], strict=True))
            case StepType.WORKDIR, 1:
                path = args[0]
                if not path.startswith("/"):
                    path = f"{state.workdir or '/home/' + state.user}/{path}"
                made = f"mkdir -p {shlex.quote(path)} && chown {shlex.quote(state.user)}:"
                script = f"[ -d {shlex.quote(path)} ] || {{ {made} {shlex.quote(path)}; }}"
                code = await shell.run(script, "root", state)
                if code != 0:
                    raise StepFailed(f"WORKDIR {path}: cannot create it")
                state.workdir = path
            case StepType.USER, 1:
                code = await shell.run(f"id -u {shlex.quote(args[0])}", "root", state)
                if code != 0:
                    raise StepFailed(f"USER {args[0]}: no such user")
                state.user = args[0]
            case _:
                raise StepFailed(f"bad step {step.type} with arguments {list(args)}")

    async def _copy(
        self, shell: GuestShell, state: BuildState, step: Step, build: Build, label: str
    ) -> None:
        src, dest, *rest = step.args
        owner = rest[0] if rest and rest[0] else state.user
        mode = rest[1] if len(rest) > 1 else ""
        if not step.files_hash or not FILES_HASH.match(step.files_hash):
            raise StepFailed(f"COPY {src}: no valid filesHash")
        path = self.files.path(build.template_id, step.files_hash)
        if not await asyncio.to_thread(self.files.touch, path):
            raise StepFailed(f"COPY {src}: files {step.files_hash} were not uploaded")
        try:
            computed = await asyncio.to_thread(tar_files_hash, path, src, dest)
        except BadArchive as e:
            raise StepFailed(f"COPY {src}: {e}") from e
        except (OSError, EOFError, ValueError) as e:  # tarfile's errors derive from these
            await asyncio.to_thread(path.unlink, True)  # the SDK uploads it again next time
            raise StepFailed(f"COPY {src}: the upload is not a gzip tar archive: {e}") from e
        if computed != step.files_hash:
            await asyncio.to_thread(path.unlink, True)
            raise StepFailed(f"COPY {src}: the uploaded files do not match filesHash")
        if mode and not re.fullmatch(r"[0-7]{3,4}", mode):
            raise StepFailed(f"COPY {src}: bad mode {mode!r}")
        staged = f"/tmp/aenv-copy-{step.files_hash}.tar.gz"
        await shell.write(staged, path)
        if not dest.startswith("/"):  # relative to the workdir, as in a Dockerfile
            dest = f"{state.workdir or '/home/' + state.user}/{dest}"
        for placed in await shell.copy(staged, src, dest, owner, mode or None):
            build.log(f"  {placed}", step=label)

    async def _start_service(
        self, shell: GuestShell, state: BuildState, spec: BuildSpec, build: Build
    ) -> None:
        """Start `startCmd` (it keeps running into the saved state) and poll `readyCmd`."""
        assert spec.start_cmd is not None
        build.log(f"Starting: {spec.start_cmd}", step="start")
        service = shell.start(
            spec.start_cmd, state.user, state, lambda line: build.log(line, step="start")
        )
        try:
            if spec.ready_cmd:
                build.log(f"Waiting for: {spec.ready_cmd}", step="ready")
                deadline = time.monotonic() + self.ready_timeout
                while await shell.run(spec.ready_cmd, state.user, state) != 0:
                    if service.done():
                        code = service.result()
                        raise BuildError(f"start command exited with code {code}", "start")
                    if time.monotonic() > deadline:
                        raise BuildError(
                            f"readyCmd did not succeed within {self.ready_timeout:.0f} s", "ready"
                        )
                    await asyncio.sleep(READY_POLL_SECONDS)
                build.log("Ready", step="ready")
        finally:
            # Dropping the output stream leaves the process running in the VM.
            service.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectError):
                await service


def _describe(step: Step) -> str:
    return f"{step.type} {' '.join(step.args)}".strip()


def _step_keys(base: Template, spec: BuildSpec, size: tuple[int, int], team: str) -> list[str]:
    """Cache key after each step: the base build, the VM size (a saved layer's memory is of
    one size) and the team (a step's output may hold what it generated: no team reuses
    another's), then every step's content and files."""
    root = f"{base.template_id}/{base.build_id}" + ("" if team == TEAM_ID else f"/{team}")
    if size != (base.cpu_count, base.memory_mb):
        root += f"/{size[0]}x{size[1]}"
    key = hashlib.sha256(root.encode()).hexdigest()
    keys = []
    for step in spec.steps:
        content = json.dumps([key, step.type, list(step.args), step.files_hash])
        key = hashlib.sha256(content.encode()).hexdigest()
        keys.append(key)
    return keys


def _layer_id(key: str) -> str:
    return f"layer-{key[:32]}"


def _with_state(template: Template, state: BuildState) -> Template:
    return dataclasses.replace(
        template,
        env_vars=dict(state.env),
        default_user=state.user,
        default_workdir=state.workdir,
    )
