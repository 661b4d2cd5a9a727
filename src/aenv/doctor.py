"""`aenv doctor`: a host checked the way a node's first hour would check it.

Each check reads what a node would use (its configuration, the host's devices, resolver, disk,
memory, kernel interfaces, its cluster services) and answers one line: passed, a warning (the
node runs, worse), or failed (it will not work as configured), with what to do. Nothing is
changed on the host, except that the guest kernel and initramfs are fetched into the guest build
cache when the KVM probe needs them and they are missing (the node's first start would).
"""

from __future__ import annotations

import asyncio
import enum
import os
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from ipaddress import IPv4Address
from pathlib import Path
from urllib.parse import urlsplit

import dns.exception
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import psutil

from aenv import claims
from aenv.config import Config
from aenv.network.dns import host_resolver
from aenv.runtime import damon
from aenv.runtime.ksm import SYSFS as KSM_SYSFS
from aenv.runtime.select import KVM_DEVICE, kvm_boots_guests

DNS_TIMEOUT_S = 3.0
# Room for the templates a node builds at its first start (base, code-interpreter-v1: their
# disks, memory files and build layers), above the reserve creates keep.
FIRST_START_DISK_MB = 8 * 1024
PROBE_TIMEOUT_S = 5.0


class Outcome(enum.StrEnum):
    PASS = "pass"  # noqa: S105 (an outcome, not a password)
    WARN = "warn"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Result:
    name: str
    outcome: Outcome
    detail: str


Check = Callable[[Config], Awaitable[Result]]


async def vmm(config: Config) -> Result:
    """KVM that boots the guest kernel, or QEMU under TCG (works, slowly)."""
    if shutil.which("qemu-system-x86_64") is None and shutil.which("firecracker") is None:
        return Result(
            "vmm", Outcome.FAIL, "neither QEMU nor Firecracker is installed: make install"
        )
    if config.driver != "auto":
        return Result("vmm", Outcome.PASS, f"{config.driver}, as configured")
    try:
        os.close(os.open(KVM_DEVICE, os.O_RDWR | os.O_CLOEXEC))
    except OSError as e:
        return _tcg(f"cannot open {KVM_DEVICE} ({e.strerror})")
    from aenv.guest.initramfs import build_initramfs
    from aenv.guest.kernel import fetch_kernel

    kernel = await fetch_kernel(config.paths.guest_cache)
    initrd = await build_initramfs(kernel, config.paths.guest_cache)
    booted, why = await kvm_boots_guests(kernel.bzimage, initrd)
    if not booted:
        return _tcg(why)
    binary = "firecracker" if shutil.which("firecracker") else "qemu-kvm"
    return Result("vmm", Outcome.PASS, f"{why}: VMs run under {binary}")


def _tcg(why: str) -> Result:
    return Result(
        "vmm",
        Outcome.WARN,
        f"{why}: VMs run under QEMU TCG, 10-50x slower; use a host with hardware KVM",
    )


async def dns_(config: Config) -> Result:
    """The node's resolver answers for the registries builds and domain rules need. Slots and
    build VMs ask it through the node (`network.dns`), so an answer here is an answer there."""
    resolver = config.network_dns or host_resolver()
    wanted = (*config.build_egress, _mirror_host(config))
    names = [n for n in dict.fromkeys(wanted) if n and "*" not in n]
    failed = await asyncio.gather(*(_unresolved(resolver, n) for n in names))
    missing = [f"{n} ({why})" for n, why in zip(names, failed, strict=True) if why]
    where = f"resolver {resolver}" + (" (network_dns)" if config.network_dns else " (the host's)")
    if not names:
        return Result("dns", Outcome.PASS, f"{where}: no registry names to resolve")
    if missing:
        return Result(
            "dns",
            Outcome.FAIL,
            f"{where} does not resolve {', '.join(missing)}: builds cannot reach the "
            "registries; set network_dns to a resolver that answers",
        )
    return Result("dns", Outcome.PASS, f"{where} resolves {', '.join(names)}")


def _mirror_host(config: Config) -> str:
    return urlsplit(config.debian_mirror).hostname or ""


async def _unresolved(resolver: IPv4Address, name: str) -> str:
    """Why `resolver` gave no address for `name`; empty when it did."""
    query = dns.message.make_query(name, dns.rdatatype.A)
    try:
        answer = await asyncio.to_thread(dns.query.udp, query, str(resolver), DNS_TIMEOUT_S)
    except (dns.exception.DNSException, OSError) as e:
        return type(e).__name__
    if not any(rrset.rdtype == dns.rdatatype.A for rrset in answer.answer):
        return dns.rcode.to_text(answer.rcode())
    return ""


async def disk(config: Config) -> Result:
    """Free space of the data directory's filesystem against the reserve creates keep."""
    where = _existing(config.home)
    free_mb = shutil.disk_usage(where).free >> 20
    detail = f"{free_mb} MiB free on {where}, reserve_disk_mb {config.reserve_disk_mb}"
    if free_mb <= config.reserve_disk_mb:
        return Result("disk", Outcome.FAIL, f"{detail}: creates would all be refused; free space")
    if free_mb < config.reserve_disk_mb + FIRST_START_DISK_MB:
        return Result(
            "disk",
            Outcome.WARN,
            f"{detail}: under {FIRST_START_DISK_MB} MiB above it for the first templates",
        )
    return Result("disk", Outcome.PASS, detail)


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


async def memory(config: Config) -> Result:
    """Available memory against the reserve and one sandbox's admission."""
    available_mb = psutil.virtual_memory().available >> 20
    needed = config.reserve_memory_mb + config.admission_sandbox_mb
    detail = f"{available_mb} MiB available, reserve_memory_mb {config.reserve_memory_mb}"
    if available_mb < needed:
        return Result("memory", Outcome.FAIL, f"{detail}: not one sandbox fits; free memory")
    return Result("memory", Outcome.PASS, detail)


async def ksm(config: Config) -> Result:
    present = (KSM_SYSFS / "run").is_file()
    if present:
        state = "on (ksm = true)" if config.ksm else "available, off (ksm = true merges pages)"
        return Result("ksm", Outcome.PASS, state)
    outcome = Outcome.FAIL if config.ksm else Outcome.WARN
    return Result("ksm", outcome, "this kernel has no KSM (CONFIG_KSM): ksm = true cannot work")


async def cold_reclaim(config: Config) -> Result:
    refusals = (await asyncio.to_thread(damon.probe)).refusals()
    if not refusals:
        return Result("damon", Outcome.PASS, "cold reclaim can run (cold_reclaim_after)")
    outcome = Outcome.FAIL if config.cold_reclaim_after else Outcome.WARN
    return Result("damon", outcome, "cold reclaim cannot run: " + "; ".join(refusals))


async def redis(config: Config) -> Result:
    if config.redis_url is None:
        return Result("redis", Outcome.PASS, "not configured (a single node)")
    import redis.asyncio as aioredis

    client = aioredis.from_url(config.redis_url, socket_connect_timeout=PROBE_TIMEOUT_S)
    try:
        await asyncio.wait_for(client.ping(), PROBE_TIMEOUT_S)
    except (OSError, TimeoutError, aioredis.RedisError) as e:
        return Result("redis", Outcome.FAIL, f"{config.redis_url} does not answer: {e!r}")
    finally:
        await client.aclose()
    return Result("redis", Outcome.PASS, f"{config.redis_url} answers")


async def repository(config: Config) -> Result:
    if not config.repository.strip().startswith("s3://"):
        return Result("s3", Outcome.PASS, "not configured (the repository is a directory or off)")
    from aenv.orchestrator.repository import open_store
    from aenv.storage.repository import BlobNotFound

    store = open_store(config)
    assert store is not None
    try:
        await asyncio.wait_for(asyncio.to_thread(store.get, "aenv-doctor-probe"), 30)
    except BlobNotFound:
        return Result("s3", Outcome.PASS, f"{config.repository} answers")
    except Exception as e:  # boto3's errors have no common base short of Exception
        return Result("s3", Outcome.FAIL, f"{config.repository} cannot be read: {e!r}")
    return Result("s3", Outcome.PASS, f"{config.repository} answers")


async def host_share(config: Config) -> Result:
    """The network prefix, slot network and jail uids this node would take are free of every
    other node running on the host (`aenv.claims`)."""
    running = claims.live()
    home = config.home.resolve()
    mine = next((c for c in running if Path(c.home) == home), None)
    if mine is not None:
        return Result(
            "claims", Outcome.PASS, f"this home's node runs (pid {mine.pid}): {_held(mine)}"
        )
    try:
        would = claims.derive(config, running, claims.netns_id())
    except claims.ClaimConflict as e:
        return Result("claims", Outcome.FAIL, str(e))
    others = f"{len(running)} other node(s) on this host" if running else "no other node here"
    return Result("claims", Outcome.PASS, f"{_held(would)} are free ({others})")


def _held(claim: claims.Claim) -> str:
    uids = claim.uids()
    jail = f"uids {uids.start}-{uids.stop - 1}" if uids else "no jail uids"
    return f"prefix {claim.network_prefix}, slot network {claim.network_cidr}, {jail}"


CHECKS: tuple[Check, ...] = (
    vmm, dns_, disk, memory, ksm, cold_reclaim, host_share, redis, repository,
)  # fmt: skip


async def examine(config: Config, checks: tuple[Check, ...] = CHECKS) -> list[Result]:
    """Every check's result, in order; one that raises is a failure naming what it raised."""
    results = []
    for check in checks:
        try:
            results.append(await check(config))
        except Exception as e:  # a check that breaks says so rather than hiding the others
            name = check.__name__.rstrip("_")
            results.append(Result(name, Outcome.FAIL, f"the check itself failed: {e!r}"))
    return results
