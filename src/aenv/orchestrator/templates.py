"""Templates: a saved VM snapshot with envd ready inside, which sandboxes are restored from.

A template lives in `$AENV_HOME/templates/<id>/` (`template.json` + the driver's snapshot files);
its guest memory file lives on tmpfs (`/dev/shm/aenv-<home hash>/templates/<id>/`), because every
restore maps it. The default template `base` is built here: boot the base image once, wait for
envd, configure it, snapshot it.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import json
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aenv import atomic
from aenv.config import Config
from aenv.envd import ENVD_VERSION
from aenv.guest.cmdline import GuestNet, kernel_cmdline
from aenv.ids import TEAM_ID, new_build_id
from aenv.network import SlotProvider
from aenv.orchestrator.build_steps import warm_up
from aenv.orchestrator.envd_client import EnvdClient, http_client
from aenv.orchestrator.images import GuestImages
from aenv.orchestrator.kinds import SaveMode, TemplateKind
from aenv.runtime.driver import (
    Disk,
    Driver,
    NetAttachment,
    RestoreError,
    Snapshot,
    SnapshotTarget,
    VMSpec,
)
from aenv.storage import layers

TEMPLATE_FILE = "template.json"
# The node's own templates: public whatever their stored flag, so that every team starts from
# them (they are built by the node, under the default team).
PUBLIC_TEMPLATES = frozenset({"base", "code-interpreter-v1"})
BOOT_READY_TIMEOUT = 180.0


class TemplateNotFound(LookupError):
    pass


@dataclass(frozen=True)
class Template:
    template_id: str
    build_id: str
    aliases: tuple[str, ...]
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    envd_version: str
    envd_access_token: str
    created_at: float
    snapshot_dir: str
    # `GuestImages.identity` of the images a built template booted from; None for snapshots and
    # for templates built before it was recorded.
    images: str | None = None
    kind: TemplateKind = TemplateKind.TEMPLATE
    source_sandbox_id: str | None = None
    # FILESYSTEM: sandboxes cold-boot from the disks (E2B's filesystem-only snapshot).
    save_mode: SaveMode = SaveMode.FULL
    # Deleted while sandboxes still run on it: hidden, and removed with the last of them.
    deleted: bool = False
    # Its copy in the snapshot repository, once stored (restores pull it when the local files
    # are gone).
    manifest_id: str | None = None
    # Set by template builds (ENV, USER, WORKDIR steps): handed to envd `/init` at every start,
    # since `/init` replaces what the saved envd had.
    env_vars: dict[str, str] = dataclasses.field(default_factory=dict)
    default_user: str | None = None
    default_workdir: str | None = None
    # The metadata of the sandbox it was saved from (a snapshot's labels: bulk deletes of
    # snapshots select by it).
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    # The team that made it (a template saved before teams: the default team's); only its keys
    # see it unless it is public (E2B's `public`: every team may start sandboxes from it).
    team_id: str = TEAM_ID
    public: bool = False

    def snapshot(self) -> Snapshot:
        return Snapshot.load_manifest(Path(self.snapshot_dir))

    @property
    def names(self) -> list[str]:
        return list(self.aliases) or [self.template_id]

    @property
    def is_public(self) -> bool:
        """Every team may see it and start sandboxes from it: published by its team, or one
        of the node's own (`PUBLIC_TEMPLATES`)."""
        return self.public or not PUBLIC_TEMPLATES.isdisjoint(self.names)

    def visible_to(self, team_id: str) -> bool:
        return self.team_id == team_id or self.is_public


def is_stale(template: Template, images: GuestImages) -> bool:
    """True when `template` was not built from `images` (or does not say what it was built
    from): its saved memory runs another envd, with another drive's page cache, than the files
    its sandboxes would now get."""
    return template.images != images.identity


class TemplateStore:
    def __init__(self, directory: Path, memory_dir: Path) -> None:
        self.directory = directory
        self.memory_dir = memory_dir
        self._templates: dict[str, Template] = {}
        # Saves run in worker threads (`asyncio.to_thread`): a change made of the record as
        # read (`update`) is read and written under this lock, so that two changes of one
        # template at once (an owner's PATCH, an upload's manifest id) both stay.
        self._lock = threading.Lock()

    def load(self) -> None:
        """Read every template whose snapshot (including its memory file) is complete."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._templates.clear()
        for meta in sorted(self.directory.glob(f"*/{TEMPLATE_FILE}")):
            try:
                template = _from_json(json.loads(meta.read_text()))
            except (OSError, ValueError, TypeError, KeyError):
                continue
            # A template with a repository copy is pulled back when its files are gone.
            if template.manifest_id is None and not _restorable(template):
                continue
            self._templates[template.template_id] = template

    def get(self, ref: str, team_id: str | None = None) -> Template:
        """A template or snapshot a user may start sandboxes from, by id or name; one
        `team_id` may see when given (its own before a public one of the same name: names are
        unique within a team)."""
        name = ref.split(":", 1)[0]  # `name:tag`: tags are not tracked yet, every tag is latest
        found = [
            t
            for t in self._templates.values()
            if not t.deleted
            and t.kind is not TemplateKind.FORK
            and (name == t.template_id or name in t.aliases)
            and (team_id is None or t.visible_to(team_id))
        ]
        found.sort(key=lambda t: t.team_id != team_id)
        if not found:
            raise TemplateNotFound(ref)
        return found[0]

    def by_id(self, template_id: str) -> Template | None:
        """Any stored template, including hidden ones (sandboxes restore from those too)."""
        return self._templates.get(template_id)

    def list(self, kind: TemplateKind = TemplateKind.TEMPLATE) -> list[Template]:
        found = [t for t in self._templates.values() if t.kind is kind and not t.deleted]
        return sorted(found, key=lambda t: t.created_at)

    def save(self, template: Template) -> None:
        with self._lock:
            self._write(template)

    def update(self, template_id: str, change: Callable[[Template], Template]) -> Template | None:
        """Save `change` of the template as stored now; None (nothing saved) if it is gone."""
        with self._lock:
            current = self._templates.get(template_id)
            if current is None:
                return None
            changed = change(current)
            self._write(changed)
            return changed

    def _write(self, template: Template) -> None:
        path = self.directory / template.template_id / TEMPLATE_FILE
        atomic.write_text(path, json.dumps(asdict(template), indent=2))
        self._templates[template.template_id] = template

    def list_all(self) -> builtins.list[Template]:
        """Every stored template, snapshot and fork checkpoint, deleted ones included."""
        return list(self._templates.values())

    def hide(self, template_id: str) -> None:
        """Deleted for users, kept on disk while sandboxes still depend on it."""
        self.update(template_id, lambda t: dataclasses.replace(t, deleted=True))

    def remove_unfinished(self) -> builtins.list[str]:
        """Remove what a crash left of templates, snapshots and fork checkpoints being saved:
        directories that never got their `template.json` (written last). Nothing can depend on
        them: sandboxes start from a saved state only after it is recorded. Returns their ids."""
        removed = []
        for entry in sorted(self.directory.iterdir()):
            if entry.is_dir() and not (entry / TEMPLATE_FILE).exists():
                shutil.rmtree(entry, ignore_errors=True)
                shutil.rmtree(self.memory_dir / entry.name, ignore_errors=True)
                removed.append(entry.name)
        return removed

    def build_memory_dir(self, template_id: str, build_id: str) -> Path:
        """Where a saved build (a snapshot's, a fork checkpoint's) keeps its memory file."""
        return self.memory_dir / template_id / build_id

    def delete(self, template_id: str) -> bool:
        template = self._templates.pop(template_id, None)
        if template is None:
            return False
        shutil.rmtree(self.directory / template_id, ignore_errors=True)
        shutil.rmtree(self.memory_dir / template_id, ignore_errors=True)
        return True


def template_to_json(template: Template) -> str:
    """The record another node adopts the template from (`template_from_json`)."""
    return json.dumps(asdict(template))


def template_from_json(text: str) -> Template:
    """Raises ValueError, KeyError or TypeError for what is not a template record."""
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("a template record is a JSON object")
    return _from_json(raw)


def _from_json(raw: dict[str, Any]) -> Template:
    """A template from its `template.json`, also as earlier versions wrote it: `memory` (a
    bool) instead of `save_mode`, and kind `layer` for both build layers and image bases."""
    raw = {**raw, "aliases": tuple(raw["aliases"])}
    if "memory" in raw:
        raw["save_mode"] = SaveMode.of(bool(raw.pop("memory")))
    if raw.get("kind") == "layer":
        image = str(raw["template_id"]).startswith("image-")
        raw["kind"] = TemplateKind.IMAGE_BASE if image else TemplateKind.BUILD_LAYER
    raw["kind"] = TemplateKind(raw.get("kind", TemplateKind.TEMPLATE))
    raw["save_mode"] = SaveMode(raw.get("save_mode", SaveMode.FULL))
    return Template(**raw)


def _restorable(template: Template) -> bool:
    try:
        snap = template.snapshot()
    except RestoreError:
        return False
    # tmpfs is cleared by a host reboot: such a template must be rebuilt.
    return snap.memory_file is None or snap.memory_file.exists()


@dataclass(frozen=True)
class BuildRequest:
    template_id: str
    aliases: tuple[str, ...]
    vcpus: int
    memory_mb: int
    disk_size_mb: int
    envd_version: str

    @classmethod
    def for_node(
        cls, config: Config, template_id: str, aliases: tuple[str, ...] = ()
    ) -> BuildRequest:
        """A template the node builds for itself, at its default sandbox size."""
        return cls(
            template_id=template_id,
            aliases=aliases,
            vcpus=config.sandbox_vcpus,
            memory_mb=config.sandbox_memory_mb,
            disk_size_mb=config.sandbox_disk_mb,
            envd_version=ENVD_VERSION,
        )


async def build_template(
    request: BuildRequest,
    images: GuestImages,
    driver: Driver,
    slots: SlotProvider,
    store: TemplateStore,
    guest_net: GuestNet,
) -> Template:
    """Cold-boot the base image, wait for envd, give it the template's token, snapshot it.

    The build writes straight into the template's final directories (a driver's disk layers may
    name the layers below them by absolute path, so a snapshot must not move afterwards);
    `template.json`, written last, is what makes it visible. On failure the directories are
    removed again.
    """
    build_id = new_build_id()
    final_dir = store.directory / request.template_id
    memory = store.memory_dir / request.template_id
    store.delete(request.template_id)
    for stale in (final_dir, memory):
        await asyncio.to_thread(shutil.rmtree, stale, True)
        stale.mkdir(parents=True)
    slot = await slots.acquire(egress=True)
    vm = None
    done = False
    try:
        vm_dir = final_dir / "build"
        vm_dir.mkdir()
        upper = await layers.new_upper(vm_dir / "upper.img", request.disk_size_mb)
        spec = VMSpec(
            vcpus=request.vcpus,
            memory_mib=request.memory_mb,
            kernel=images.kernel,
            initrd=images.initrd,
            cmdline=kernel_cmdline(guest_net, hostname="sandbox"),
            workdir=vm_dir,
            disks=(
                Disk("root", images.rootfs, read_only=True),
                Disk("upper", upper),
                Disk("envd", images.envd_drive, read_only=True),
            ),
            net=NetAttachment(slot.netns, slot.guest.tap, slot.guest.mac),
            memory_dir=memory,
        )
        vm = await driver.boot(spec)
        token = secrets.token_hex(24)
        async with http_client() as http:
            envd = EnvdClient(http, str(slot.address))
            await envd.wait_healthy(BOOT_READY_TIMEOUT)
            envd = await envd.init(new_token=token, env_vars={}, hostname="sandbox", timeout=30)
            await warm_up(envd, "user")
        snap_dir = final_dir / "snapshot"
        snap_dir.mkdir()
        snapshot = await vm.snapshot(
            SnapshotTarget(directory=snap_dir, memory_dir=memory), keep_running=False
        )
        await asyncio.to_thread(snapshot.save_manifest)
        vm = None
        template = Template(
            template_id=request.template_id,
            build_id=build_id,
            aliases=request.aliases,
            cpu_count=request.vcpus,
            memory_mb=request.memory_mb,
            disk_size_mb=request.disk_size_mb,
            envd_version=request.envd_version,
            envd_access_token=token,
            created_at=time.time(),
            snapshot_dir=str(snap_dir),
            images=images.identity,
        )
        store.save(template)
        done = True
        return template
    finally:
        if vm is not None:
            await vm.stop()
        await slots.release(slot)
        await asyncio.to_thread(shutil.rmtree, final_dir / "build", True)
        if not done:
            for partial in (final_dir, memory):
                await asyncio.to_thread(shutil.rmtree, partial, True)
