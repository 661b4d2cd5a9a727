"""What a running node holds on its host that no other node may take: its data directory, the
name prefix of its network slots (namespaces under /run/netns, host interfaces, the nftables
table), its slot network within its network namespace, and its jailed VMMs' uid range.

Each live node holds a claim: a JSON file under `CLAIMS_DIR` locked (flock) by the node for as
long as it runs. The kernel drops the lock when the process ends, however it ends, so a claim
whose lock can be taken is stale and is removed. A node starting takes the directory's lock,
reads the live claims, and is refused (`ClaimConflict`, naming the setting to change) when its
home (or one inside or around it), prefix, slot network (in the same network namespace) or uid
range meets one of them.
Otherwise it writes its own claim before it lets the directory go, so two nodes starting at once
see each other.

Settings the operator left unset are derived (`derive`): the default home keeps the values of
earlier versions (prefix `aenv`, `10.200.0.0/16`, uids from 2000000), so an upgraded node finds
its old slots; any other home gets a prefix from a hash of its path and the first slot network
and uid range, from a place its hash picks, that no live node holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from ipaddress import IPv4Network
from pathlib import Path

from aenv.config import DEFAULT_HOME, Config, ConfigError
from aenv.runtime.jail import DEFAULT_UID_COUNT

CLAIMS_DIR = Path("/run/aenv/nodes")
LEGACY_PREFIX = "aenv"
LEGACY_CIDR = IPv4Network("10.200.0.0/16")
LEGACY_UID_BASE = 2_000_000
# Derived slot networks: the /21s (512 slots each, room for `max_sandboxes`' default of 256 and
# the warm slots) of this /13 outside the legacy network.
DERIVED_SPAN = IPv4Network("10.200.0.0/13")
DERIVED_PREFIXLEN = 21
# Derived uid ranges: blocks of `jail_uid_count` + 1 after the legacy range, below 2**31.
DERIVED_UID_BLOCKS = 32_000
UID_LIMIT = 2**31


class ClaimConflict(ConfigError):
    """Another live node holds what this configuration asks for; nothing was claimed."""


@dataclass(frozen=True)
class Claim:
    """What one node holds. `netns` identifies the network namespace its slot network is in;
    `uid_base` is None when its VMMs run unjailed."""

    home: str
    pid: int
    network_prefix: str
    network_cidr: str
    netns: str
    uid_base: int | None
    uid_count: int

    @property
    def cidr(self) -> IPv4Network:
        return IPv4Network(self.network_cidr)

    def uids(self) -> range:
        """The group id and the users' ids."""
        if self.uid_base is None:
            return range(0)
        return range(self.uid_base, self.uid_base + self.uid_count + 1)


class HeldClaim:
    """A claim this process holds until `release` (or its end)."""

    def __init__(self, claim: Claim, path: Path, fd: int) -> None:
        self.claim = claim
        self._path = path
        self._fd: int | None = fd

    def release(self) -> None:
        """Give the claim up. Idempotent."""
        if self._fd is None:
            return
        self._path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def _hash(home: Path) -> int:
    return int.from_bytes(hashlib.sha256(str(home).encode()).digest()[:8], "big")


def netns_id() -> str:
    """This process's network namespace, as claims name it."""
    st = os.stat("/proc/self/ns/net")
    return f"{st.st_dev}:{st.st_ino}"


def _is_default(home: Path) -> bool:
    return home == DEFAULT_HOME.resolve()


def _blocks() -> list[IPv4Network]:
    subnets = DERIVED_SPAN.subnets(new_prefix=DERIVED_PREFIXLEN)
    return [block for block in subnets if not block.overlaps(LEGACY_CIDR)]


def derive(config: Config, live: Sequence[Claim], netns: str) -> Claim:
    """This node's claim: the configured values, and derived ones for those left unset (see the
    module docstring). Raises `ClaimConflict` when a value meets a live claim."""
    home = config.home.resolve()
    for other in live:
        their_home = Path(other.home)
        # Nested homes are shared too: a node's sweeps end the VMMs whose files are under its
        # home (aenv.runtime.sweep).
        if home.is_relative_to(their_home) or their_home.is_relative_to(home):
            raise ClaimConflict(
                f"the node of {their_home} (pid {other.pid}) runs on a data directory that is, "
                f"contains or is inside {home}: give each node a home of its own"
            )
    seed = _hash(home)
    default = _is_default(home)
    prefix = config.network_prefix or (
        LEGACY_PREFIX if default else f"{LEGACY_PREFIX}{seed & 0xFFFF:04x}"
    )
    for other in live:
        if other.network_prefix == prefix:
            raise ClaimConflict(
                f"network_prefix {prefix!r} is held by the node of {other.home} (pid {other.pid})"
                ": set another network_prefix"
            )
    same_ns = [other for other in live if other.netns == netns]
    cidr = config.network_cidr
    if cidr is None:
        cidr = LEGACY_CIDR if default else _first_free(_blocks(), seed, same_ns)
    for other in same_ns:
        if other.cidr.overlaps(cidr):
            raise ClaimConflict(
                f"network_cidr {cidr} overlaps {other.cidr} of the node of {other.home} "
                f"(pid {other.pid}) in this network namespace: set another network_cidr"
            )
    uid_base = config.jail_uid_base
    count = config.jail_uid_count
    if config.jail and uid_base is None:
        uid_base = LEGACY_UID_BASE if default else _free_uids(seed, count, live)
    if not config.jail:
        uid_base = None
    claim = Claim(str(home), os.getpid(), prefix, str(cidr), netns, uid_base, count)
    for other in live:
        mine, theirs = claim.uids(), other.uids()
        if mine and theirs and mine.start < theirs.stop and theirs.start < mine.stop:
            raise ClaimConflict(
                f"jail_uid_base: uids {mine.start}-{mine.stop - 1} overlap {theirs.start}-"
                f"{theirs.stop - 1} of the node of {other.home} (pid {other.pid}): set another "
                "jail_uid_base"
            )
    return claim


def _first_free(blocks: list[IPv4Network], seed: int, live: Sequence[Claim]) -> IPv4Network:
    for step in range(len(blocks)):
        block = blocks[(seed + step) % len(blocks)]
        if not any(other.cidr.overlaps(block) for other in live):
            return block
    raise ClaimConflict("every derived slot network is held by a live node: set network_cidr")


def _free_uids(seed: int, count: int, live: Sequence[Claim]) -> int:
    size = count + 1  # the group id, then the users
    first = LEGACY_UID_BASE + DEFAULT_UID_COUNT + 1  # past the legacy range
    blocks = min(DERIVED_UID_BLOCKS, (UID_LIMIT - first) // size)
    for step in range(blocks):
        base = first + size * ((seed + step) % blocks)
        if not any(base < o.uids().stop and o.uids().start < base + size for o in live):
            return base
    raise ClaimConflict("every derived jail uid range is held by a live node: set jail_uid_base")


def claim(config: Config, directory: Path = CLAIMS_DIR) -> HeldClaim:
    """Claim what `config` asks for (derived where unset) for this process, or raise
    `ClaimConflict` naming the live node it meets and the setting to change."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _locked(directory / ".lock"):
        live = list(_live_claims(directory))
        mine = derive(config, live, netns_id())
        path = directory / f"{_hash(Path(mine.home)):016x}.json"
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, json.dumps(asdict(mine)).encode())
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return HeldClaim(mine, path, fd)


def live(directory: Path = CLAIMS_DIR) -> list[Claim]:
    """The claims of the nodes running now (stale ones are removed)."""
    if not directory.is_dir():
        return []
    with _locked(directory / ".lock"):
        return list(_live_claims(directory))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _live_claims(directory: Path) -> Iterator[Claim]:
    """The claims of live nodes; stale ones (their lock is free) are removed."""
    for path in sorted(directory.glob("*.json")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                with os.fdopen(os.dup(fd)) as f:
                    yield Claim(**json.load(f))
                continue
            path.unlink(missing_ok=True)  # its node is gone
        finally:
            os.close(fd)
