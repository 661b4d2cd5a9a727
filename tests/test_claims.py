"""Claims of the nodes on one host: derived settings that two homes never share, refusals that
name the live node and the setting to change, and claims of dead nodes given up. Real locks on
real files; the nodes are processes of this test (a held claim is an open, locked file)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from aenv.claims import (
    LEGACY_CIDR,
    LEGACY_PREFIX,
    LEGACY_UID_BASE,
    UID_LIMIT,
    ClaimConflict,
    claim,
    derive,
)
from aenv.config import DEFAULT_HOME, Config, ConfigError


def test_nodes_that_set_only_their_homes_share_nothing(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    first = claim(Config(home=tmp_path / "a"), claims)
    second = claim(Config(home=tmp_path / "b"), claims)
    try:
        a, b = first.claim, second.claim
        assert a.network_prefix != b.network_prefix
        assert not a.cidr.overlaps(b.cidr) and a.netns == b.netns
        assert not set(a.uids()) & set(b.uids())
        for derived in (a, b):  # nor anything with a node of the default home
            assert derived.network_prefix != LEGACY_PREFIX
            assert not derived.cidr.overlaps(LEGACY_CIDR)
            assert derived.uids().start > LEGACY_UID_BASE + 65_536
    finally:
        first.release()
        second.release()


def test_derived_settings_are_stable_and_the_default_home_keeps_the_old_ones(
    tmp_path: Path,
) -> None:
    home = Config(home=tmp_path / "a")
    assert derive(home, [], "net") == derive(home, [], "net")
    default = derive(Config(home=DEFAULT_HOME), [], "net")
    assert (default.network_prefix, default.cidr, default.uid_base) == (
        LEGACY_PREFIX,
        LEGACY_CIDR,
        LEGACY_UID_BASE,
    )


@pytest.mark.parametrize("count", [1, 65_536, 50_000_000])
def test_derived_uid_ranges_stay_below_2_to_the_31(tmp_path: Path, count: int) -> None:
    uids = derive(Config(home=tmp_path / "a", jail_uid_count=count), [], "net").uids()
    assert uids.start > LEGACY_UID_BASE + 65_536 and uids.stop <= UID_LIMIT
    assert len(uids) == count + 1


def test_a_derived_network_or_uid_range_a_live_node_holds_is_passed_over(tmp_path: Path) -> None:
    home = Config(home=tmp_path / "b")
    wanted = derive(home, [], "net")
    squatter = Config(
        home=tmp_path / "a",
        network_prefix="squat",
        network_cidr=wanted.cidr,
        jail_uid_base=wanted.uid_base,
    )
    live = [derive(squatter, [], "net")]
    got = derive(home, live, "net")
    assert not got.cidr.overlaps(wanted.cidr) and got.uid_base != wanted.uid_base


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("network_prefix", "shared"),
        ("network_cidr", "10.99.0.128/25"),
        ("jail_uid_base", 4_000_100),
    ],
)
def test_an_explicit_setting_a_live_node_holds_is_refused(
    tmp_path: Path, setting: str, value: object
) -> None:
    claims = tmp_path / "claims"
    explicit = {
        "network_prefix": "shared",
        "network_cidr": "10.99.0.0/24",
        "jail_uid_base": 4_000_000,
    }
    live = claim(Config.model_validate({"home": tmp_path / "a", **explicit}), claims)
    try:
        owner = re.escape(str(tmp_path / "a"))
        with pytest.raises(ClaimConflict, match=rf"^{setting}\b.*{owner}.*set another {setting}$"):
            claim(Config.model_validate({"home": tmp_path / "b", setting: value}), claims)
        assert list(claims.glob("*.json")) == [live._path]  # the refused node claimed nothing
    finally:
        live.release()
    assert issubclass(ClaimConflict, ConfigError)  # the CLI reports it as a configuration error


def test_a_network_in_another_namespace_is_no_conflict(tmp_path: Path) -> None:
    cidr = {"network_cidr": "10.99.0.0/24"}
    live = [derive(Config.model_validate({"home": tmp_path / "a", **cidr}), [], "other-net")]
    assert derive(Config.model_validate({"home": tmp_path / "b", **cidr}), live, "net")


@pytest.mark.parametrize("other", [".", "inner", ".."])
def test_two_nodes_on_one_home_or_nested_homes_are_refused(tmp_path: Path, other: str) -> None:
    claims = tmp_path / "claims"
    live = claim(Config(home=tmp_path / "a"), claims)
    try:
        with pytest.raises(ClaimConflict, match="give each node a home of its own"):
            claim(Config(home=tmp_path / "a" / other, network_prefix="other"), claims)
    finally:
        live.release()
    claim(Config(home=tmp_path / "a" / other), claims).release()  # given up: free again


def test_the_claim_of_a_dead_node_is_given_up(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    child = (
        "import sys, pathlib\n"
        "from aenv.claims import claim\n"
        "from aenv.config import Config\n"
        "held = claim(Config(home=pathlib.Path(sys.argv[1]), network_prefix='dead'),"
        " pathlib.Path(sys.argv[2]))\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child, str(tmp_path / "a"), str(claims)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        with pytest.raises(ClaimConflict, match="network_prefix 'dead'"):
            claim(Config(home=tmp_path / "b", network_prefix="dead"), claims)
        proc.kill()  # no release: the kernel drops its lock
        proc.wait()
        held = claim(Config(home=tmp_path / "b", network_prefix="dead"), claims)
        held.release()
        assert list(claims.glob("*.json")) == []
    finally:
        proc.kill()
        proc.wait()
