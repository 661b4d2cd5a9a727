"""`aenv server`: one node, one port. Wires config, catalog, VMM driver, network slots, templates,
orchestrator, control plane and data plane together, and owns start-up and shutdown order.

The data-plane proxy is the outermost app: requests carrying E2B's sandbox routing (headers,
`{port}-{id}.{domain}` hosts, `/proxy/...`) go to sandboxes, everything else to the control plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from starlette.types import Scope

from aenv.api.app import create_api, node_builder
from aenv.api.internal import OPERATOR_CALLER, caller, caller_key
from aenv.api.keys import KeyStore, open_keys
from aenv.claims import Claim, HeldClaim, claim
from aenv.config import Config, ConfigError
from aenv.dashboard.app import Dashboard
from aenv.guest.cmdline import GuestNet
from aenv.network import NetworkConfig, SlotPool
from aenv.network.dns import host_resolver
from aenv.orchestrator.builds import Builder
from aenv.orchestrator.catalog import Catalog
from aenv.orchestrator.envd_client import EnvdClient
from aenv.orchestrator.identity_keys import node_signer
from aenv.orchestrator.images import GuestImages, prepare_images
from aenv.orchestrator.kinds import TemplateKind
from aenv.orchestrator.lifecycle import OperationFailed, Orchestrator, SandboxNotFound
from aenv.orchestrator.memory_savers import MemorySavers
from aenv.orchestrator.migrations import NewerCatalog
from aenv.orchestrator.repository import open_archive
from aenv.orchestrator.secrets import SecretStore, node_key
from aenv.orchestrator.templates import (
    BuildRequest,
    Template,
    TemplateNotFound,
    TemplateStore,
    build_template,
    is_stale,
)
from aenv.proxy.access import API_KEY_HEADER
from aenv.proxy.app import SandboxProxy
from aenv.proxy.resolver import SandboxNotFound as ProxyNotFound
from aenv.proxy.resolver import SandboxPaused as ProxyPaused
from aenv.proxy.resolver import SandboxUnavailable as ProxyUnavailable
from aenv.proxy.resolver import Upstream
from aenv.proxy.signed import signer
from aenv.runtime.cgroups import CgroupManager, CgroupV1, detect
from aenv.runtime.damon import ColdReclaim, ColdReclaimError, ReclaimSettings, follow, node_targets
from aenv.runtime.driver import Driver
from aenv.runtime.firecracker import FirecrackerConfig, FirecrackerDriver
from aenv.runtime.firecracker.host import find_binary
from aenv.runtime.firecracker.jailer import JailerConfig
from aenv.runtime.jail import JailConfig
from aenv.runtime.ksm import Ksm, KsmSettings
from aenv.runtime.select import Backend, driver_for, select_backend
from aenv.runtime.sweep import sweep
from aenv.storage.private import make_private

log = logging.getLogger("aenv.server")
Progress = Callable[[str], None]


@dataclass
class Node:
    """Everything a running server holds, in start-up order."""

    config: Config
    keys: KeyStore
    catalog: Catalog
    slots: SlotPool
    orchestrator: Orchestrator
    cgroups: CgroupManager
    app: SandboxProxy
    builder: Builder
    held: HeldClaim
    ksm: Ksm | None = None
    cold_reclaim: ColdReclaim | None = None
    following: asyncio.Task[None] | None = None

    async def close(self) -> None:
        await self.app.aclose()
        await self.orchestrator.close()
        await self.slots.close()
        self.cgroups.remove_parent()
        self.catalog.close()
        if self.ksm is not None:
            await asyncio.to_thread(self.ksm.restore)
        if self.following is not None:
            self.following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.following
        if self.cold_reclaim is not None:
            await asyncio.to_thread(self.cold_reclaim.stop)
        self.held.release()


def _guest_net(slots: NetworkConfig) -> GuestNet:
    return GuestNet(address=str(slots.guest.ip), gateway=str(slots.guest.gateway), dns="1.1.1.1")


def jail_config(claimed: Claim) -> JailConfig | None:
    """The jail of the node's VMMs, with the uid range it claimed; None when the jail is off."""
    if claimed.uid_base is None:
        return None
    return JailConfig(uid_base=claimed.uid_base, uid_count=claimed.uid_count)


def firecracker_config(
    config: Config, cgroups: CgroupManager, jail: JailConfig | None
) -> FirecrackerConfig:
    """The Firecracker driver's settings (the driver and the startup sweep of its leftovers
    share them): every Firecracker goes through its jailer, unless the jail is off (`jail`
    None), with a uid of its own from the jail's range, as QEMU's VMMs; its chroots are under
    the data dir."""
    if jail is None:
        return FirecrackerConfig()
    jailer = JailerConfig(
        binary=Path("jailer"),
        uid=jail.uid_base,
        gid=jail.gid,
        chroot_base_dir=config.paths.jailer,
        cgroup_version=1 if isinstance(cgroups, CgroupV1) else 2,
    )
    return FirecrackerConfig(jailer=jailer, jail_uids=jail)


async def _driver(
    config: Config,
    images: GuestImages,
    cgroups: CgroupManager,
    jail: JailConfig | None,
    progress: Progress,
) -> Driver:
    selection = await select_backend(config.driver, kernel=images.kernel, initrd=images.initrd)
    progress(f"VMM: {selection.backend} ({selection.reason})")
    firecracker = FirecrackerConfig()
    if selection.backend is Backend.FIRECRACKER:
        firecracker = _jailed_firecracker(config, cgroups, jail)
    return driver_for(
        selection,
        cgroups=cgroups,
        firecracker=firecracker,
        jail=jail,
        tb_size_mib=config.tcg_tb_mib,
        share_slots=config.share_slots,
    )


def _jailed_firecracker(
    config: Config, cgroups: CgroupManager, jail: JailConfig | None
) -> FirecrackerConfig:
    """`firecracker_config` with the jailer binary found on PATH (refused without it)."""
    settings = firecracker_config(config, cgroups, jail)
    jailer = settings.jailer
    if jailer is None:
        return settings
    found = find_binary(jailer.binary)
    if found is None:
        raise RuntimeError(
            "Firecracker runs only under its jailer: install `jailer` (it ships with "
            "firecracker) on PATH, or set jail = false (benchmarks and debugging only)"
        )
    return dataclasses.replace(settings, jailer=dataclasses.replace(jailer, binary=found))


async def start_node(config: Config, progress: Progress = log.info) -> Node:
    """The node, started. Refused with a `ConfigError` before anything is made when another
    live node on the host holds what the configuration asks for (`aenv.claims`) or the host
    cannot do what it asks (cold reclaim); a start that fails later undoes what it made."""
    async with contextlib.AsyncExitStack() as undo:
        held = await asyncio.to_thread(claim, config)
        undo.callback(held.release)
        progress(
            f"network slots {held.claim.network_prefix}-* in {held.claim.network_cidr}"
            + ("" if held.claim.uid_base is None else f", jail uids from {held.claim.uid_base}")
        )
        reclaim = await _cold_reclaim(config, progress)
        if reclaim is not None:
            undo.push_async_callback(asyncio.to_thread, reclaim.stop)
        node = await _start_node(config, held, progress, reclaim, undo)
        undo.pop_all()
    if reclaim is not None:
        targets = functools.partial(node_targets, config.home)
        node.following = asyncio.create_task(follow(reclaim, targets))
    return node


async def _cold_reclaim(config: Config, progress: Progress) -> ColdReclaim | None:
    """The node's kdamond, made (off until VMMs run) when `cold_reclaim_after` is set; a
    kdamond a killed server of this node left is removed either way."""
    settings = ReclaimSettings(
        cold_after_s=config.cold_reclaim_after,
        bytes_per_s=config.cold_reclaim_mb_per_s << 20,
        ms_per_s=config.cold_reclaim_ms_per_s,
    )
    reclaim = ColdReclaim(settings, config.paths.damon)
    try:
        if not config.cold_reclaim_after:
            await asyncio.to_thread(reclaim.remove_stale)
            return None
        operations = await asyncio.to_thread(reclaim.start)
    except ColdReclaimError as e:
        raise ConfigError(
            f"cold_reclaim_after = {config.cold_reclaim_after} cannot be honoured here: {e}"
        ) from e
    progress(f"cold reclaim on: {operations} operations, pages idle {settings.cold_after_s} s")
    return reclaim


async def _start_node(
    config: Config,
    held: HeldClaim,
    progress: Progress,
    reclaim: ColdReclaim | None,
    undo: contextlib.AsyncExitStack,
) -> Node:
    """`start_node` once the claim is held; what it makes is undone by `undo` if it fails."""
    claimed = held.claim
    jail = jail_config(claimed)
    make_private(*_private_dirs(config))
    keys, created = open_keys(config.paths)
    if created:
        progress(f"generated an API key; it is in {config.paths.api_key} (mode 0600)")
    try:
        catalog = Catalog(config.paths.catalog)
    except NewerCatalog as e:
        raise ConfigError(str(e)) from e
    undo.callback(catalog.close)
    try:
        secret_store = SecretStore(catalog, node_key(config))
        identity = node_signer(config)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    net_config = NetworkConfig(
        prefix=claimed.network_prefix,
        slot_network=claimed.cidr,
        pool_low=config.warm_slots_low,
        pool_high=config.warm_slots_high,
        private_allowed=config.network_private_allowed,
        internal=config.network_internal,
        dns_upstream=config.network_dns or host_resolver(),
        egress_ca=config.paths.egress_ca,
        upstream_ca=config.network_rules_ca,
        secrets=secret_store,
        signer=identity,
    )
    slots = SlotPool(net_config)
    undo.push_async_callback(slots.close)
    await slots.start()
    progress("preparing guest images (cached after the first start)...")
    images = await prepare_images(
        config.paths.cache, config.paths.guest_cache, config.debian_mirror
    )
    cgroups = detect(f"aenv-{os.getpid()}")
    undo.callback(cgroups.remove_parent)
    # VMMs of a previous server that died live on as orphans: reclaim them, and the cgroups, jails
    # and files of its Firecracker VMs (whichever driver runs now), before anything new.
    swept = await sweep(
        cgroups,
        home=config.home,
        reclaimers=[FirecrackerDriver(firecracker_config(config, cgroups, jail))],
    )
    if swept.killed:
        progress(f"killed {len(swept.killed)} VMMs a previous run left behind")
    driver = await _driver(config, images, cgroups, jail, progress)
    images = images.booted_by(driver)
    templates = TemplateStore(config.paths.templates, config.paths.memory)
    templates.load()
    orchestrator = Orchestrator(
        config,
        catalog,
        driver,
        slots,
        templates,
        open_archive(config),
        secrets=secret_store,
        signer=identity,
    )
    undo.push_async_callback(orchestrator.close)
    await orchestrator.start()
    current: Template | None
    try:
        current = templates.get(config.default_template)
    except TemplateNotFound:
        current = None
    if current is None or is_stale(current, images):
        why = "first start" if current is None else "its guest images changed"
        progress(f"building the default template '{config.default_template}' ({why})...")
        template_id = current.template_id if current else config.default_template
        # Paused sandboxes' disk layers stack on their template's by path: while they exist,
        # the old build stays (hidden) and the new one gets another id.
        if _in_use(catalog, templates.directory / template_id):
            template_id = f"{config.default_template}-{secrets.token_hex(4)}"
        template = await build_template(
            BuildRequest.for_node(config, template_id, (config.default_template,)),
            images,
            driver,
            slots,
            templates,
            _guest_net(net_config),
        )
        if current is not None and current.template_id != template.template_id:
            templates.hide(current.template_id)  # removed with the last sandbox it has
        progress(f"template '{template.template_id}' ready")

    async def boot_image(rootfs: Path, digest: str) -> Template:
        """A hidden base template cold-booted from an image's root filesystem (template
        builds `fromImage`), once per image digest and guest images."""
        key = hashlib.sha256(f"{digest}/{images.identity}".encode()).hexdigest()[:20]
        existing = templates.by_id(f"image-{key}")
        if existing is not None and existing.kind is TemplateKind.IMAGE_BASE:
            return existing
        built = await build_template(
            BuildRequest.for_node(config, f"image-{key}"),
            dataclasses.replace(images, rootfs=rootfs),
            driver,
            slots,
            templates,
            _guest_net(net_config),
        )
        hidden = dataclasses.replace(built, kind=TemplateKind.IMAGE_BASE)
        templates.save(hidden)
        return hidden

    builder = node_builder(orchestrator, config, boot_image)
    api = create_api(orchestrator, config, keys, builder, MemorySavers(cold_reclaim=reclaim))
    proxy = SandboxProxy(
        _Resolver(orchestrator),
        domain=config.domain,
        control_plane=Dashboard(api, _Shells(orchestrator)),
        signer=lambda signed: signer(
            signed, ((r.id, r.envd_access_token) for r in orchestrator.catalog.list())
        ),
        tenancy=_Tenancy(orchestrator, keys),
    )
    orchestrator.vm_stopped.append(proxy.end_run)  # a stopped VM's streams end at once
    orchestrator.hibernation.traffic = proxy  # idle hibernation waits for quiet traffic
    ksm = await _ksm(config, progress)
    return Node(
        config, keys, catalog, slots, orchestrator, cgroups, proxy, builder, held, ksm, reclaim
    )


async def _ksm(config: Config, progress: Progress) -> Ksm | None:
    """The host's KSM started with the configured tuning, or None when not configured."""
    if not config.ksm:
        return None
    ksm = Ksm()
    settings = KsmSettings(pages_to_scan=config.ksm_pages_to_scan, sleep_ms=config.ksm_sleep_ms)
    await asyncio.to_thread(ksm.enable, settings)
    progress(f"KSM on: {settings.pages_to_scan} pages every {settings.sleep_ms} ms")
    return ksm


def _private_dirs(config: Config) -> list[Path]:
    """The node's data directories: its home, its tmpfs directory and a repository directory
    elsewhere (see storage/private.py)."""
    dirs = [config.home, config.paths.memory]
    repository = config.repository_dir
    if repository is not None and not repository.resolve().is_relative_to(config.home.resolve()):
        dirs.append(repository)  # inside home, home's mode already keeps it
    return dirs


def _in_use(catalog: Catalog, template_dir: Path) -> bool:
    """Whether some sandbox was started from a saved state in `template_dir`."""
    prefix = f"{template_dir}/"
    return any(r.restored_from.startswith(prefix) for r in catalog.list())


class _Shells:
    """The dashboard's terminals' view of the orchestrator: a sandbox's envd, woken first when
    the node hibernated it, as the data plane does."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self._orchestrator = orchestrator

    async def envd(self, sandbox_id: str) -> EnvdClient:
        try:
            await self._orchestrator.endpoint_for_traffic(sandbox_id)
            return self._orchestrator.envd(sandbox_id)
        except (SandboxNotFound, OperationFailed) as e:
            raise LookupError(sandbox_id) from e


class _Tenancy:
    """The data plane's view of teams (`proxy.access.check_team`): the team of the API key a
    request carries, the node's own or the one a cluster gateway checked and names
    (`api.internal`), and each sandbox's team in the catalog."""

    def __init__(self, orchestrator: Orchestrator, keys: KeyStore) -> None:
        self._orchestrator = orchestrator
        self._keys = keys

    async def caller_team(self, scope: Scope) -> str | None:
        named = caller(scope.get("state", {}))
        if named is not None and named != OPERATOR_CALLER:
            return caller_key(named).team_id
        given = next((v for n, v in scope["headers"] if n == API_KEY_HEADER), None)
        key = self._keys.verify(given.decode("latin-1")) if given else None
        return None if key is None else key.team_id

    def sandbox_team(self, sandbox_id: str) -> str | None:
        record = self._orchestrator.catalog.get(sandbox_id)
        return None if record is None else record.team_id


class _Resolver:
    """The data plane's view of the orchestrator: where a running sandbox's port is."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self._orchestrator = orchestrator

    async def resolve(self, sandbox_id: str, port: int) -> Upstream:
        try:
            endpoint = await self._orchestrator.endpoint_for_traffic(sandbox_id)
        except SandboxNotFound as e:
            if self._orchestrator.is_paused(sandbox_id):
                raise ProxyPaused(sandbox_id) from e
            raise ProxyNotFound(sandbox_id) from e
        except OperationFailed as e:  # an auto-resume or a wake that failed
            raise ProxyUnavailable(sandbox_id, str(e)) from e
        record = endpoint.record
        return Upstream(
            endpoint.host,
            port,
            record.traffic_access_token,
            endpoint.incarnation,
            record.network.mask_request_host,
            port in record.network.https_ports,
        )
