"""A node's start next to other nodes on one host, without guests: refused before it makes
anything when a live node holds what it asks for, undone when it fails half-way, and a guest
build cache shared read-only. Servers run in network namespaces of their own
(`tests.e2e.server_ns`); the read-only cache is a read-only bind mount."""

from __future__ import annotations

import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from ipaddress import IPv4Network
from pathlib import Path

from aenv.claims import CLAIMS_DIR, claim
from aenv.config import Config, Paths
from aenv.orchestrator.images import prepare_images
from tests.e2e.server_ns import PREFIX, ServerNs, in_netns, server_in_namespace
from tests.support.guest import GUEST_CACHE, MIRROR

# Slot names `<prefix>-<n>` fit in 15 characters with 64 slots.
CIDR = "10.201.0.0/24"


@contextmanager
def read_only_view(source: Path, at: Path) -> Iterator[Path]:
    """`source` bind-mounted read-only at `at`, as a cache another host's node fills."""
    at.mkdir()
    subprocess.run(["mount", "--bind", str(source), str(at)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(at)], check=True)
        yield at
    finally:
        subprocess.run(["umount", str(at)], check=True)


def exit_code(server: ServerNs) -> int:
    """The server's exit status; it must end by itself (a refused start does at once)."""
    assert server.proc is not None
    return server.proc.wait(timeout=300)


def namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{prefix}-")]


def tables(server: ServerNs) -> str:
    done = subprocess.run(in_netns(server.netns, "nft", "list", "tables"), capture_output=True)
    return done.stdout.decode()


def test_a_setting_a_live_node_holds_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    prefix = f"{PREFIX}c"
    live_home = tmp_path / "live"
    held = claim(
        Config(home=live_home, network_prefix=prefix, network_cidr=IPv4Network("10.203.0.0/24"))
    )
    try:
        home = tmp_path / "home"
        settings = {"AENV_NETWORK_PREFIX": prefix, "AENV_NETWORK_CIDR": CIDR}
        with server_in_namespace(home, settings=settings) as server:
            code = exit_code(server)
            log = server.log.read_text()
            assert code == 2, log
            assert f"network_prefix '{prefix}' is held by the node of {live_home}" in log, log
            assert "set another network_prefix" in log
            assert namespaces(prefix) == [] and prefix not in tables(server)
            assert not Paths(home).catalog.exists()
    finally:
        held.release()


def test_a_catalog_of_a_newer_aenv_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    """A home whose catalog a newer aenv numbered: the start stops with a configuration error
    naming the versions, the catalog byte for byte as it was, no slot made."""
    prefix = f"{PREFIX}v"
    home = tmp_path / "home"
    catalog = Paths(home).catalog
    catalog.parent.mkdir(parents=True)
    db = sqlite3.connect(catalog)
    db.execute("CREATE TABLE sandboxes (id TEXT PRIMARY KEY, shape TEXT)")
    db.execute("PRAGMA user_version = 99")
    db.commit()
    db.close()
    before = catalog.read_bytes()
    settings = {"AENV_NETWORK_PREFIX": prefix, "AENV_NETWORK_CIDR": CIDR}
    with server_in_namespace(home, settings=settings) as server:
        code = exit_code(server)
        log = server.log.read_text()
        assert code == 2, log
        assert f"the catalog {catalog} has schema version 99, and this aenv knows up to" in log
        assert namespaces(prefix) == [] and prefix not in tables(server)
    assert catalog.read_bytes() == before


def test_a_failed_start_removes_what_it_made(tmp_path: Path) -> None:
    prefix = f"{PREFIX}f"
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    home = tmp_path / "home"
    with read_only_view(empty, tmp_path / "cache") as cache:
        settings = {
            "AENV_NETWORK_PREFIX": prefix,
            "AENV_NETWORK_CIDR": CIDR,
            "AENV_GUEST_CACHE": str(cache),
        }
        with server_in_namespace(home, settings=settings) as server:
            code = exit_code(server)
            log = server.log.read_text()
            assert code == 2, log
            assert f"the guest cache {cache} is read-only and holds no kernel" in log, log
            # Slots were being made when the start failed: none is left, nor their table.
            assert namespaces(prefix) == [], log
            assert prefix not in tables(server), log
    assert not any(str(home) in p.read_text() for p in CLAIMS_DIR.glob("*.json"))


async def test_a_guest_cache_shared_read_only_serves_a_node(tmp_path: Path) -> None:
    filled = await prepare_images(Paths(tmp_path / "filler").cache, GUEST_CACHE, MIRROR)
    with read_only_view(GUEST_CACHE, tmp_path / "shared") as shared:
        images = await prepare_images(Paths(tmp_path / "home").cache, shared, MIRROR)
    assert images.identity == filled.identity
    for image in (images.kernel, images.initrd, images.rootfs, images.envd_drive):
        assert image.is_relative_to(tmp_path / "home") and image.is_file()
