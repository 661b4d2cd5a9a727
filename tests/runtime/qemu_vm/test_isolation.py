"""Isolation with real VM clones: the network between sandboxes, and a guest that fills its memory.

Network: two clones of the session template (booted on a tap, like every clone) are restored into
two slots of a real `SlotPool`. Its "host" is a namespace made here and joined to an "internet"
namespace as in tests/network, so the real host's interfaces, sysctls and nftables are never
touched. Connections from inside a guest are made by a program the guest agent runs (`POST /run`):
they leave through the guest's own kernel, virtio NIC, tap and slot, as sandboxed code's would.
Every negative probe runs next to a positive one in the same guest program (the internet, which
the same clone reaches), so a blocked connection is the network's doing, not a broken probe.

Memory: one clone allocates four times its RAM. Either the guest's OOM killer stops the program
(the VMM lives on and the clone still answers), or the VMM's cgroup limit stops the VMM (it is
reported stopped and releases everything); in both cases the other clone answers with its state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from aenv.network import Slot, SlotPool
from aenv.runtime.cgroups import Cgroup, CgroupManager
from aenv.runtime.driver import VM, Limits, NetAttachment, RestoreSpec, VMState
from aenv.runtime.qemu import QemuDriver, QemuVM
from tests.network import probes
from tests.network.conftest import (
    HOST_UPLINK_IP,
    INET_IP,
    World,
    new_world,
    skip_unless_root_and_nft,
)
from tests.runtime.qemu_vm.conftest import (
    TEMPLATE_MEMORY,
    TEMPLATE_NOTE,
    Fleet,
    Places,
    Template,
    qemu_children,
)
from tests.runtime.qemu_vm.netns import agent

pytestmark = pytest.mark.slow

ENVD_PORT = 49983
HOST_PORT = 3000  # a service on all of the test host's addresses
LOOPBACK_PORT = 3001  # a service on the test host's loopback only
INET_PORT = 80
PROBE_TIMEOUT_S = 3.0
T = TypeVar("T")

# Runs in the guest: connect to every target at once; per target "connected <greeting>" or why not.
PROBE = r"""
import errno, json, socket, sys, threading
targets, timeout, out = json.loads(sys.argv[1]), float(sys.argv[2]), {}
def probe(ip, port):
    key = f"{ip}:{port}"
    try:
        sock = socket.create_connection((ip, port), timeout=timeout)
    except socket.timeout:
        out[key] = "timeout"
        return
    except OSError as exc:
        out[key] = errno.errorcode.get(exc.errno, str(exc))
        return
    try:
        out[key] = "connected " + sock.recv(200).decode(errors="replace").strip()
    except OSError:
        out[key] = "connected"
    finally:
        sock.close()
threads = [threading.Thread(target=probe, args=tuple(t)) for t in targets]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(out))
"""

# Runs in the guest: allocate and touch 1 MiB blocks up to argv[1] MiB. It volunteers as the OOM
# killer's victim, as a sandbox's own programs are meant to be rather than the agent serving it.
HOG = r"""
import sys
with open("/proc/self/oom_score_adj", "w") as f:
    f.write("1000")
blocks = []
for mib in range(int(sys.argv[1])):
    blocks.append(b"\x5a" * (1 << 20))
    if mib % 32 == 0:
        print(mib, flush=True)
print("allocated all", flush=True)
"""


async def run_in_guest(netns: str, argv: list[str], timeout_s: float, **kw: Any) -> Any:
    body = json.dumps({"argv": argv, "timeout": timeout_s}).encode()
    headers = {"Content-Type": "application/json"}
    return await agent(netns, "POST", "/run", body=body, headers=headers, **kw)


async def guest_probe(netns: str, targets: list[tuple[str, int]], **kw: Any) -> dict[str, str]:
    """What each `ip:port` looks like from inside the guest behind `netns`."""
    argv = ["python3", "-c", PROBE, json.dumps(targets), str(PROBE_TIMEOUT_S)]
    result = await run_in_guest(netns, argv, PROBE_TIMEOUT_S + 60, **kw)
    assert result["rc"] == 0, result
    seen: dict[str, str] = json.loads(result["stdout"])
    return seen


async def unless_stopped(vm: VM, request: Coroutine[Any, Any, T]) -> T | None:
    """The request's result, or None if the VM stopped first."""

    async def stopped() -> None:
        while vm.state is not VMState.STOPPED:
            await asyncio.sleep(0.05)

    answer, death = asyncio.ensure_future(request), asyncio.ensure_future(stopped())
    try:
        done, _ = await asyncio.wait({answer, death}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (answer, death):
            task.cancel()
        await asyncio.gather(answer, death, return_exceptions=True)
    if answer not in done:
        return None
    error = answer.exception()
    if error is None:
        return answer.result()
    try:  # a request cut short by the VMM's death is that death, not an error of its own
        await asyncio.wait_for(stopped(), 10)
    except TimeoutError:
        raise error from None
    return None


def oom_kills(group: Cgroup) -> int:
    """How many processes the kernel's OOM killer killed in a VMM's memory cgroup (v1 or v2)."""
    directories = getattr(group, "dirs", None) or (group.directory,)  # type: ignore[attr-defined]
    for d in directories:
        for name in ("memory.oom_control", "memory.events"):
            if (d / name).is_file():
                counters = dict(line.split() for line in (d / name).read_text().splitlines())
                return int(counters["oom_kill"])
    raise AssertionError(f"no memory cgroup among {directories}")


def connected(outcome: str) -> bool:
    return outcome.startswith("connected")


@dataclass(frozen=True)
class Sandbox:
    vm: VM
    slot: Slot

    @property
    def address(self) -> str:
        return str(self.slot.address)


@dataclass(frozen=True)
class Net:
    world: World
    pool: SlotPool
    a: Sandbox
    b: Sandbox

    async def from_host(self, box: Sandbox, method: str = "GET", path: str = "/") -> Any:
        """A request to a clone's agent from the host side, through the slot address."""
        return await agent(self.world.host, method, path, address=box.address)

    async def from_guest(self, box: Sandbox, targets: list[tuple[str, int]]) -> dict[str, str]:
        return await guest_probe(self.world.host, targets, address=box.address, limit_s=120)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    skip_unless_root_and_nft()
    with new_world() as w:
        yield w


@pytest.fixture(scope="module")
async def services(world: World) -> AsyncIterator[None]:
    servers: list[asyncio.Server] = []
    try:
        servers.append(await probes.serve(world.host, "0.0.0.0", HOST_PORT, "host"))
        servers.append(await probes.serve(world.host, "127.0.0.1", LOOPBACK_PORT, "host-lo"))
        servers.append(await probes.serve(world.inet, INET_IP, INET_PORT, "inet"))
        yield
    finally:
        for server in servers:
            server.close()
            await server.wait_closed()


# Class scope: the clones must be gone before the memory tests, whose `no_leaks` counts VMMs.
@pytest.fixture(scope="class")
async def net(
    world: World,
    services: None,
    driver: QemuDriver,
    places: Places,
    template: Template,
    cgroups: CgroupManager,
) -> AsyncIterator[Net]:
    pool = SlotPool(world.config())
    vms: list[VM] = []
    try:
        await pool.start()
        slots = [await pool.acquire(egress=True) for _ in range(2)]
        targets = [
            RestoreSpec(
                workdir=places.vm_dir(),
                net=NetAttachment(netns=s.netns, tap=s.guest.tap, mac=s.guest.mac),
                memory_dir=places.shm,
            )
            for s in slots
        ]
        vms = await driver.restore_many(template.snapshot, targets)
        a, b = (Sandbox(vm, slot) for vm, slot in zip(vms, slots, strict=True))
        yield Net(world, pool, a, b)
    finally:
        for vm in vms:
            await vm.stop()  # before the slots go: the VMMs hold their taps
        await pool.close()
    assert qemu_children() == [], "a QEMU process outlived the isolation tests"
    assert cgroups.names() == [], "a VMM cgroup outlived the isolation tests"
    assert world.leftovers() == [], "a slot namespace outlived SlotPool.close()"


class TestSlots:
    """Two clones in two slots, shared by the tests of this class."""

    async def test_the_host_reaches_each_clone_through_its_slot_address(self, net: Net) -> None:
        for box in (net.a, net.b):
            state = await net.from_host(box)
            assert (state["memory"], state["note"]) == (TEMPLATE_MEMORY, TEMPLATE_NOTE)
        # Each address leads to its own clone: what one is told, the other does not hear.
        await net.from_host(net.a, "POST", "/?memory=only-a&note=note-a")
        await net.from_host(net.b, "POST", "/?memory=only-b&note=note-b")
        assert (await net.from_host(net.a))["memory"] == "only-a"
        assert (await net.from_host(net.b))["memory"] == "only-b"
        # The services the clones must not reach are up and reachable where they should be.
        assert await probes.probe(net.world.host, "127.0.0.1", LOOPBACK_PORT) is not None
        assert await probes.probe(net.world.host, HOST_UPLINK_IP, HOST_PORT) is not None

    @pytest.mark.parametrize("direction", ["a-to-b", "b-to-a"])
    async def test_a_clone_reaches_neither_the_other_nor_the_host(
        self, net: Net, direction: str
    ) -> None:
        me, other = (net.a, net.b) if direction == "a-to-b" else (net.b, net.a)
        forbidden = [
            # The other clone, through everything of its slot the host side has.
            (other.address, ENVD_PORT),
            (other.address, HOST_PORT),
            (str(other.slot.host_ip), ENVD_PORT),
            (str(other.slot.host_ip), HOST_PORT),
            # The test host's own services, at each of its addresses the clone knows of.
            (str(me.slot.host_ip), HOST_PORT),
            (str(me.slot.host_ip), LOOPBACK_PORT),
            (HOST_UPLINK_IP, HOST_PORT),
            (HOST_UPLINK_IP, LOOPBACK_PORT),
            # Its own slot namespace (the gateway and the slot address) offers nothing either.
            (str(me.slot.guest.gateway), HOST_PORT),
            (me.address, HOST_PORT),
        ]
        # 127.0.0.1 in a guest is the guest's own loopback: whatever answers there is not the host.
        outcomes = await net.from_guest(me, [(INET_IP, INET_PORT), ("127.0.0.1", LOOPBACK_PORT)])
        outcomes |= await net.from_guest(me, forbidden)
        # The probe works (the internet answers, seeing the test host's masquerading address)...
        assert outcomes.pop(f"{INET_IP}:{INET_PORT}") == f"connected inet {HOST_UPLINK_IP}"
        assert not connected(outcomes.pop(f"127.0.0.1:{LOOPBACK_PORT}"))
        # ...and nothing else is reached: no connection, nor a refusal that betrays a live peer.
        reached = {t: o for t, o in outcomes.items() if connected(o) or o == "ECONNREFUSED"}
        assert reached == {}, outcomes
        assert len(outcomes) == len(forbidden)
        # The other clone is alive all along: it is the path that is closed.
        assert (await net.from_host(other))["hits"] > 0

    async def test_egress_off_really_blocks_and_only_that_sandbox(self, net: Net) -> None:
        inet = [(INET_IP, INET_PORT)]
        key = f"{INET_IP}:{INET_PORT}"
        try:
            await net.pool.set_egress(net.a.slot, False)
            # Refused at once by the slot's `prohibit` route, not left to time out.
            assert (await net.from_guest(net.a, inet))[key] == "EHOSTUNREACH"
            assert connected((await net.from_guest(net.b, inet))[key])
            # Egress off never cuts the host's path to the guest.
            assert (await net.from_host(net.a))["hits"] > 0
        finally:
            await net.pool.set_egress(net.a.slot, True)
        assert connected((await net.from_guest(net.a, inet))[key])


@pytest.mark.parametrize(
    "cgroup_mib",
    [None, 160],
    ids=["guest-oom-killer", "vmm-cgroup-limit"],
)
async def test_a_guest_that_fills_its_memory_harms_no_other(
    fleet: Fleet,
    template: Template,
    driver: QemuDriver,
    cgroups: CgroupManager,
    cgroup_mib: int | None,
) -> None:
    """`None`: the VMM's default cgroup limit exceeds what the guest can use, so the guest's OOM
    killer must act. 160 MiB: the VMM's cgroup is smaller than the guest's RAM, so the host kernel
    must kill the VMM before the guest runs out."""
    other, other_netns = await fleet.restore(template.snapshot)
    target = fleet.target()
    target = dataclasses.replace(target, limits=Limits(memory_max_mib=cgroup_mib))
    hog = await driver.restore(template.snapshot, target)
    fleet.vms.append(hog)
    assert target.net is not None
    hog_netns = target.net.netns
    await agent(other_netns, "POST", "/?memory=other-memory&note=other-note")
    await agent(hog_netns, "POST", "/?memory=hog-memory&note=hog-note")
    memory_mib = template.snapshot.spec.memory_mib

    argv = ["python3", "-c", HOG, str(4 * memory_mib)]
    # A VMM killed under a request leaves its connection hanging (the tap stays): stop waiting
    # for the answer once the VM is gone.
    result = await unless_stopped(hog, run_in_guest(hog_netns, argv, 240, limit_s=300))

    assert isinstance(hog, QemuVM)
    console = hog.console_log.read_text(errors="replace")
    outcome = f"{result}, VMM exit {hog.proc.returncode}, guest console:\n{console[-3000:]}"
    if cgroup_mib is None:
        # The guest's OOM killer stopped the program; its VMM and its agent live on.
        assert result is not None and result["rc"] == -signal.SIGKILL, outcome
        assert "allocated all" not in result["stdout"]
        assert hog.state is VMState.RUNNING
        state = await agent(hog_netns)
        assert (state["memory"], state["note"]) == ("hog-memory", "hog-note")
        assert "Out of memory" in console, outcome
    else:
        # The host kernel killed the VMM inside its cgroup: the VM reports itself stopped, and
        # stopping it releases its cgroup and files.
        assert result is None, outcome
        assert hog.state is VMState.STOPPED
        assert hog.proc.returncode == -signal.SIGKILL, outcome
        assert hog.cgroup is not None and oom_kills(hog.cgroup) >= 1, outcome
        await hog.stop()
        assert not any(name.endswith(hog.id) for name in cgroups.names())
        assert [p.name for p in target.workdir.iterdir() if p.suffix != ".log"] == []

    # The other sandbox never noticed.
    assert other.state is VMState.RUNNING
    state = await agent(other_netns)
    assert (state["memory"], state["note"]) == ("other-memory", "other-note")
    await agent(other_netns, "POST", "/?memory=later&note=still-writable")
    assert (await agent(other_netns))["note"] == "still-writable"
