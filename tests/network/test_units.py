"""Pure logic: the address plan and configuration checks."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Interface, IPv4Network

import pytest

from aenv.network import GuestNetwork, NetworkConfig, SlotsExhausted
from aenv.network.addressing import AddressPlan


def test_each_slot_gets_its_own_30() -> None:
    plan = AddressPlan(IPv4Network("10.200.0.0/16"))
    assert plan.capacity == 16384
    assert (plan.host_ip(0), plan.slot_ip(0)) == (
        IPv4Address("10.200.0.1"),
        IPv4Address("10.200.0.2"),
    )
    assert (plan.host_ip(16383), plan.slot_ip(16383)) == (
        IPv4Address("10.200.255.253"),
        IPv4Address("10.200.255.254"),
    )
    with pytest.raises(ValueError):
        plan.subnet(16384)


def test_indices_are_reused_as_late_as_possible() -> None:
    plan = AddressPlan(IPv4Network("10.200.0.0/28"))  # 4 slots
    assert [plan.allocate() for _ in range(3)] == [0, 1, 2]
    plan.free(1)
    assert plan.allocate() == 3
    assert plan.allocate() == 1
    with pytest.raises(SlotsExhausted):
        plan.allocate()
    plan.free(0)
    assert plan.allocate() == 0
    assert plan.in_use == 4
    with pytest.raises(ValueError):
        plan.free(7)


@pytest.mark.parametrize(
    "bad",
    [
        {"prefix": "Aenv"},
        {"prefix": "a-b"},
        {"prefix": "averylongprefix"},  # <prefix>-16383 would not fit IFNAMSIZ
        {"slot_network": IPv4Network("10.0.0.0/31")},
        {"slot_network": IPv4Network("10.0.0.0/8")},  # overlaps the guest network
        {"pool_low": 5, "pool_high": 4},
    ],
)
def test_config_rejects(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        NetworkConfig(**bad)  # type: ignore[arg-type]


def test_guest_gateway_must_be_on_the_guest_network() -> None:
    with pytest.raises(ValueError):
        GuestNetwork(ip=IPv4Interface("10.0.2.15/24"), gateway=IPv4Address("10.0.3.2"))
